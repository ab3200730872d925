"""rlfp8: colocated LoRA reinforcement learning on one GPU with one FP8 copy of the base model.

Layout (arrows only go down): kernels -> algos -> trainer / rollout -> data -> train.py.
See docs/ARCHITECTURE.md.
"""
__version__ = "0.1.0"
