"""``BatchUnsupported``: the one error every batched layer raises for what cannot decode together."""


class BatchUnsupported(ValueError):
    """These caches (or this model) cannot decode as one batch; decode the rows one at a time."""
