"""The project's side of the PTX interpreter (the `ptxsim` package, tools/ptxsim): how its kernels
are compiled (build: nvcc with the extension's flags, Triton for every launchable configuration,
a content-addressed cache), the host glue that launches them as the bindings do (cuda_glue,
allreduce_glue, triton_glue; layouts and symbols read from the shipped headers by shipped), the
census of their PTX and the counters report. tests/ptx and tools/sass_report.py use it."""
