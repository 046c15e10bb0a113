"""python -m spec_kernels.bench compare OLD.json NEW.json [--threshold 5%]
python -m spec_kernels.bench plan [--gpu h200] [--impl cuda|triton] [--grid decode-step|tree-verify]"""
import argparse
import sys

from . import compare, plan


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spec_kernels.bench", description="benchmark result tools")
    commands = parser.add_subparsers(dest="command", required=True)
    compare.add_parser(commands)
    plan.add_parser(commands)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
