"""``BatchUnsupported``: the one error every batched layer raises for what cannot decode together."""

from ..kernels.observe import is_routed


class BatchUnsupported(ValueError):
    """These caches (or this model) cannot decode as one batch; decode the rows one at a time."""


def check_batched_call(layer: int, keys, rows: int, attended: bool) -> None:
    """Raise ``BatchUnsupported`` unless a batched layer's call is one token for each of its ``rows``, with the
    model's attention routed through Velox and the last call's ``attended`` (it reached the layer)."""
    if keys.shape[2] != 1 or keys.shape[0] != rows:
        raise BatchUnsupported(
            f"layer {layer}: a batch takes one token per row per call, got {keys.shape[0]} rows x {keys.shape[2]}"
        )
    if not is_routed():
        raise BatchUnsupported(
            "batched decoding needs the model's attention routed through Velox: run it inside "
            "`velox_cache.observe(model)` or `velox_cache.fast_attention(model)`"
        )
    if not attended:
        raise BatchUnsupported(f"layer {layer}: the last call's attention did not reach Velox (not routable)")
