"""Tiny, deterministic models for the end-to-end server tests (no hub access).

`make_models(root)` writes, from fixed seeds:

* a byte-level BPE tokenizer trained here with the ``tokenizers`` library on a fixed corpus
  (saved into both model directories);
* ``root/target``: a Llama (``LlamaForCausalLM``, fp32, GQA: 4 query heads over 2 KV heads of
  dim 64, 2 layers), written with transformers' ``save_pretrained``;
* ``root/draft``: an EAGLE-3 draft in the layout of SGLang's ``LlamaForCausalLMEagle3`` (one
  decoder layer whose attention reads [embedding ; hidden], width 2 x hidden, an ``fc`` over the
  target's captured hidden states, ``hidden_norm``). It has no embedding and no lm_head of its
  own: ``draft_vocab_size`` is null, so SGLang's EAGLE-3 worker gives it the target's embedding
  and lm_head ("shared head").

A random draft would almost never be accepted, so the pair is built to agree often:

* the target's embedding rows have RMS 1 and a constant first coordinate; its lm_head is random;
  its layers are random, with their output projections (``o_proj``, ``down_proj``) scaled by
  ``LAYER_SCALE``: the last hidden state is the current token's embedding plus a smaller,
  context-dependent (attention) part. So the target's greedy next token is usually, not always,
  the "bigram" token ``argmax lm_head . norm(embed(x))``;
* the draft computes exactly that bigram token: its query and key read the constant coordinate,
  so with rotary embeddings every query attends (weights within e^-35 of one-hot) to its own
  position, whose value is the current token's normalised embedding minus the normalised
  incoming hidden state (which cancels the residual carried from the previous draft step); its
  ``fc`` and MLP output are zero.

With ``LAYER_SCALE`` 0.3 about two thirds of the target's greedy tokens are bigram tokens
(EAGLE-3 chains of 4 accept about 2 tokens per step), the smallest top-1 / top-2 logit gap
along the test continuations is about 0.1 (far above fp32 round-off), and attention still
decides a third of the tokens, so a wrong verify mask changes the outputs.

The target keeps two hidden states for the draft (``eagle_aux_hidden_state_layer_ids`` [-1, 0]:
SGLang captures the input of layers 0 and 1).
"""
from __future__ import annotations

import json
import os

HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 256
TARGET_LAYERS = 2
VOCAB = 384
CONTEXT = 512
AUX_LAYER_IDS = [-1, 0]
LAYER_SCALE = 0.3
MLA_LATENT = 128  # DeepSeek-V2 style target: kv_lora_rank (the latent, also the value) ...
MLA_ROPE = 32  # ... and qk_rope_head_dim
# Query/key size of the draft's self-attention: the score gap between a position and its
# nearest neighbour is QK_SCALE^2 x 1.083 / 4 (rotary frequencies of head dim 64, theta 1e4).
QK_SCALE = 12.0
SEED = 1234

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts a few tokens and the target model verifies them in one step",
    "a tree of draft tokens shares its prefix; each draft attends to its ancestors only",
    "the key value cache holds one row per token and per layer",
    "greedy decoding picks the most likely token at every position",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "pack my box with five dozen liquor jugs",
    "how vexingly quick daft zebras jump",
]
PROMPTS = [
    "the quick brown fox",
    "speculative decoding drafts",
    "numbers 0 1 2 3",
]


def _train_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def _fill_target(model, vocab: int) -> None:
    """Embedding rows of RMS 1 with a constant first coordinate, a random lm_head, random layers
    whose output projections are scaled by LAYER_SCALE (see the module docstring)."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        emb = torch.randn(vocab, HIDDEN, generator=g)
        emb[:, 1:] *= (HIDDEN - 1) ** 0.5 / emb[:, 1:].norm(dim=1, keepdim=True)
        emb[:, 0] = 1.0  # RMS of every row: exactly 1
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(torch.randn(vocab, HIDDEN, generator=g))
        for layer in model.model.layers:
            for name, lin in layer.named_modules():  # definition order: q, k, v, o, gate, up, down
                if not isinstance(lin, torch.nn.Linear):
                    continue
                scale = LAYER_SCALE if name.endswith(("o_proj", "down_proj")) else 1.0
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * scale / lin.weight.shape[1] ** 0.5)


def _target(path: str, vocab: int, bos: int, eos: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                      num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                      bos_token_id=bos, eos_token_id=eos, dtype="float32")
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    _fill_target(model, vocab)
    model.save_pretrained(path)
    return model


def _mla_target(path: str, vocab: int, bos: int, eos: int):
    """A DeepSeek-V2 style MLA target: latent (kv_lora_rank) 128 + rope 32, 4 heads, 2 dense layers.
    Rotary scaling is YaRN with factor 1 (= plain RoPE), the only kind SGLang's CPU engine builds
    for DeepSeek attention."""
    import json

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    rope = {"rope_type": "yarn", "type": "yarn", "factor": 1.0, "original_max_position_embeddings": CONTEXT,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    cfg = DeepseekV2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                           moe_intermediate_size=64, num_hidden_layers=TARGET_LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=HEADS, kv_lora_rank=MLA_LATENT, q_lora_rank=None,
                           qk_rope_head_dim=MLA_ROPE, qk_nope_head_dim=32, v_head_dim=32,
                           first_k_dense_replace=TARGET_LAYERS, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                           bos_token_id=bos, eos_token_id=eos, rope_parameters=rope)
    torch.manual_seed(SEED)
    model = DeepseekV2ForCausalLM(cfg).to(torch.float32).eval()
    _fill_target(model, vocab)
    model.save_pretrained(path)
    # SGLang reads two fields transformers does not write: the MoE layer frequency (no MoE layer
    # here: first_k_dense_replace covers all layers) and rope_scaling.
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as fh:
        data = json.load(fh)
    data.update(moe_layer_freq=1, rope_scaling=rope)
    with open(cfg_path, "w") as fh:
        json.dump(data, fh, indent=2)
    return model


def _draft(path: str, vocab: int, bos: int, eos: int, aux_layer_ids=AUX_LAYER_IDS) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": CONTEXT, "vocab_size": vocab, "draft_vocab_size": None,
        "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
        "target_hidden_size": HIDDEN,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
    }
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
    g = torch.Generator().manual_seed(SEED + 1)
    # The attention input is [input_layernorm(embedding) ; hidden_norm(hidden)], 2 x HIDDEN wide.
    q = torch.zeros(HEADS * HEAD_DIM, 2 * HIDDEN)
    q[:, 0] = QK_SCALE  # the embedding's constant coordinate: every head's query is constant
    k = torch.zeros(KV_HEADS * HEAD_DIM, 2 * HIDDEN)
    k[:, 0] = QK_SCALE
    eye = torch.eye(HIDDEN)
    v = torch.cat([eye, -eye], dim=1)  # KV head h: embedding[64h:64h+64] - hidden[64h:64h+64]
    o = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
    group = HEADS // KV_HEADS
    for h in range(KV_HEADS):  # one query head per KV head carries its value to the output
        qh = h * group
        o[h * HEAD_DIM:(h + 1) * HEAD_DIM, qh * HEAD_DIM:(qh + 1) * HEAD_DIM] = torch.eye(HEAD_DIM)
    p = "midlayer."
    tensors = {
        "fc.weight": torch.zeros(HIDDEN, HIDDEN * len(aux_layer_ids)),
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": v,
        p + "self_attn.o_proj.weight": o,
        p + "mlp.gate_proj.weight": torch.randn(INTERMEDIATE, HIDDEN, generator=g) / HIDDEN ** 0.5,
        p + "mlp.up_proj.weight": torch.randn(INTERMEDIATE, HIDDEN, generator=g) / HIDDEN ** 0.5,
        p + "mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE),
        p + "input_layernorm.weight": torch.ones(HIDDEN),
        p + "hidden_norm.weight": torch.ones(HIDDEN),
        p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        "norm.weight": torch.ones(HIDDEN),
    }
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def make_models(root: str, mla: bool = False) -> dict:
    """Write tokenizer, target and draft under `root`; returns their paths and the prompts' ids.
    `mla`: the target is the DeepSeek-V2 style MLA model (its draft captures only layer 0's
    output: SGLang's DeepSeek model captures no hidden state before its first layer)."""
    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    tok = _train_tokenizer(target)
    tok.save_pretrained(draft)
    vocab = len(tok)
    if mla:
        _mla_target(target, vocab, tok.bos_token_id, tok.eos_token_id)
        _draft(draft, vocab, tok.bos_token_id, tok.eos_token_id, aux_layer_ids=[0])
    else:
        _target(target, vocab, tok.bos_token_id, tok.eos_token_id)
        _draft(draft, vocab, tok.bos_token_id, tok.eos_token_id)
    prompts = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    return {"target": target, "draft": draft, "prompt_ids": prompts}


def hf_greedy(target: str, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation (generate, do_sample=False) of each prompt, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                           eos_token_id=None, pad_token_id=0)
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)
            out.append(y[0, len(ids):].tolist())
    return out


def greedy_margins(target: str, prompt_ids: list[list[int]], outputs: list[list[int]]) -> float:
    """The smallest top-1 minus top-2 logit gap along the given greedy continuations."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    gap = float("inf")
    with torch.no_grad():
        for ids, cont in zip(prompt_ids, outputs):
            x = torch.tensor([ids + cont[:-1]])
            logits = model(x).logits[0, len(ids) - 1:]
            top2 = logits.topk(2, dim=-1).values
            gap = min(gap, float((top2[:, 0] - top2[:, 1]).min()))
    return gap
