"""skippy: serve one LLM across processes or hosts by splitting it into contiguous layer ranges.

Each stage loads layers [a, b) of a GGUF model into a patched llama.cpp, takes hidden states from
upstream over a binary TCP protocol, computes, and forwards downstream; the final stage samples.
"""

__version__ = "0.1.0"
