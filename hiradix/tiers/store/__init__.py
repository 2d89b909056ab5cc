"""Cluster-store backends (placeholder until the Mooncake backend lands in this branch)."""


def backend_names() -> list[str]:
    return ["mooncake"]


def make_backend(name: str, config_text: str):
    raise NotImplementedError("the Mooncake backend is being merged")
