"""The tiny model's checkpoint: a real safetensors file of seeded weights.

Every full tensor comes from a generator seeded by its name, so the weights do not
depend on the tensor-parallel size (vLLM's own weight loaders shard them).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

from .configs import CONFIG, SEED


def checkpoint_shapes(config: dict[str, Any] = CONFIG) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's Hugging Face checkpoint (DeepSeek-V2 names), full size.

    ``q_lora_rank`` is None (a plain ``q_proj``) and every MLP is dense. vLLM 0.33's
    ``DeepseekV2ForCausalLM.load_weights`` maps these names onto its parameters and
    each parameter's weight loader takes the rank's shard: ``q_proj`` and
    ``kv_b_proj`` (ColumnParallelLinear) by output rows, i.e. by heads; ``o_proj``
    and ``down_proj`` (RowParallelLinear) by input columns; ``gate_proj`` and
    ``up_proj`` into the merged column-parallel ``gate_up_proj``;
    ``kv_a_proj_with_mqa`` and the norms replicated; ``embed_tokens`` and
    ``lm_head`` by vocabulary rows.
    """
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    rank, v = int(config["kv_lora_rank"]), int(config["v_head_dim"])
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        at = f"model.layers.{i}"
        shapes |= {
            f"{at}.input_layernorm.weight": (hidden,),
            f"{at}.self_attn.q_proj.weight": (heads * (nope + rope), hidden),
            f"{at}.self_attn.kv_a_proj_with_mqa.weight": (rank + rope, hidden),
            f"{at}.self_attn.kv_a_layernorm.weight": (rank,),
            f"{at}.self_attn.kv_b_proj.weight": (heads * (nope + v), rank),
            f"{at}.self_attn.o_proj.weight": (hidden, heads * v),
            f"{at}.post_attention_layernorm.weight": (hidden,),
            f"{at}.mlp.gate_proj.weight": (inter, hidden),
            f"{at}.mlp.up_proj.weight": (inter, hidden),
            f"{at}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def seeded_tensor(name: str, shape: tuple[int, ...]) -> Any:
    """The full tensor ``name``: norms 1, embeddings N(0, 1), matrices N(0, 1/fan_in).

    Drawn from a generator seeded by ``SEED`` and the name alone (not by the order
    of the parameters or by a rank's shard), in float32, then rounded to bfloat16.
    """
    import torch

    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
    scale = 1.0 if "embed" in name else shape[-1] ** -0.5
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def write_checkpoint(model_dir: Path, config: dict[str, Any] = CONFIG) -> str:
    """``config.json`` and ``model.safetensors`` of the seeded weights; the file's sha256."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {
        name: seeded_tensor(name, shape) for name, shape in checkpoint_shapes(config).items()
    }
    path = model_dir / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hashlib.sha256(path.read_bytes()).hexdigest()
