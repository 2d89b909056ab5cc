"""hiradix: a three-tier (HBM -> DRAM -> NVMe) radix prefix cache for SGLang."""
__version__ = "0.1.0"
