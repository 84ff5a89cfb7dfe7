"""The policy: checkpoints (checkpoint.py: checked and loaded; model_import.py: made from a GGUF file), the
embedded tiny model (tiny.py) and the generation engines (transformers_engine.py, vllm_engine.py; their common
types in engine.py), chosen by name in engine_registry.py. Import from those modules: this package imports
nothing, so reading a config or checking a checkpoint does not import torch."""
