"""Model preparation: corpus, byte-level BPE tokenizer, a small Llama, training, HF export.

corpus.py     text files/folders (default: the stdlib) and the fixed held-out packages
tokenizer.py  byte-level BPE with <s>/</s>/<pad>, saved for AutoTokenizer
model.py      the training Llama (plain PyTorch, HF-identical numerics)
config.py     TrainConfig: a run's shape and optimisation settings (torch-free)
trainer.py    AdamW + warmup/cosine, packed windows, validation, checkpoint/resume
export.py     HF LlamaForCausalLM folder (config.json, model.safetensors, ...)
command.py    `minfer train`

The shipped model lives in minfer/assets/builtin-model (see minfer.llm.builtin_model_path).

Nothing heavy is imported here, so `import minfer.train` stays cheap.
"""
