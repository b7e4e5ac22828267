"""fusegen: compile Transformers models into static, fused model files."""

__version__ = "0.1.0"
