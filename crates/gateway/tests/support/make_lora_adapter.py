"""A tiny LoRA adapter for the tiny model, for the real-vLLM LoRA test (tests/vllm_lora.rs).

    python make_lora_adapter.py BASE_MODEL_DIR OUT_DIR [SEED]

Writes a PEFT adapter (rank 8 on q_proj and v_proj, random non-zero weights from SEED, so
the adapter changes the model's output) that `vllm serve --enable-lora --lora-modules
NAME=OUT_DIR` loads. Needs torch, transformers and peft (`pip install peft` into the vLLM
venv). For the tiny model of ../../../../shared/peers/make_tiny_model.py it is about 15 KB.
"""

import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

base, out = sys.argv[1], sys.argv[2]
seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
torch.manual_seed(seed)
model = AutoModelForCausalLM.from_pretrained(base)
config = LoraConfig(
    r=8,
    lora_alpha=16,
    target_modules=["q_proj", "v_proj"],
    init_lora_weights=False,  # random A and B: a visible change, unlike the default B = 0
    task_type="CAUSAL_LM",
)
get_peft_model(model, config).save_pretrained(out)
print(f"wrote {out}")
