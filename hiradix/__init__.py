"""hiradix: a tiered (HBM -> DRAM -> NVMe -> cluster store) radix prefix cache for SGLang."""
__version__ = "0.1.0"
