"""Weights in and out: the model on meta (:mod:`.builder`), lazy slice reads of
safetensors (:mod:`.safetensors_io`), filling a rewritten module from a Hugging Face
folder (:mod:`.hf_fill`), our sharded checkpoint format (:mod:`.sharded_format`),
gathering dense tensors (:mod:`.gather`) and exporting a checkpoint as a dense
Hugging Face folder (:mod:`.export`). Built on the IR and the runtime.
"""
