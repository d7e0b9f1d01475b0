"""Build a LoRA adapter for the tiny model of build_model.py, in PEFT's layout, with no hub access.

Run with the vLLM environment's Python (it has torch and safetensors):
    python build_lora.py MODEL_DIR OUT_DIR
Writes adapter_config.json and adapter_model.safetensors as PEFT saves them (`save_pretrained`): tensors named
base_model.model.model.layers.N.self_attn.{q,v}_proj.lora_{A,B}.weight, A of shape (r, in), B of shape (out, r).
vLLM reads that layout (vllm/lora/lora_model.py: LoRAModel.from_local_checkpoint; the names parsed by
vllm/lora/utils.py: parse_fine_tuned_lora_name). Small random weights, seeded: the same output for the same model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj")


def main(model: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = hidden // heads
    out_features = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    torch.manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(out_features[target], RANK) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model), "r": RANK,
        "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None,
    }, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
