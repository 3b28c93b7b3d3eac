"""A decode failure injected for one document's full variant: a decode whose rows include it raises.

Its rows are the full variant's rows whose prompt holds ``POISON``: decoding one alone
raises too (as does a batch it joins, mid-decode), decoding any other row alone does not. Run as a
script, it is ``velox-batch`` with the injection in place (for tests that kill the process).
"""

import sys

import pipeline.execute

MARK = "POISON"
_original = pipeline.execute.generate_together


def _poisoned(tokenizer, run) -> bool:
    return run.config.method == "full" and MARK in tokenizer.decode(run.row.sampler.prompt)


def poisoned_generate_together(model, tokenizer, runs, **options):
    """Raises once a poisoned row is among the runs, or joins them (``more``: mid-decode)."""
    if any(_poisoned(tokenizer, run) for run in runs):
        raise RuntimeError("injected: a poisoned row")
    more = options.get("more")
    if more is not None:
        def checked(rows):
            joining = more(rows)
            if any(_poisoned(tokenizer, run) for run in joining):
                raise RuntimeError("injected: a poisoned row")
            return joining

        options["more"] = checked
    return _original(model, tokenizer, runs, **options)


def install(monkeypatch=None) -> None:
    if monkeypatch is not None:
        monkeypatch.setattr(pipeline.execute, "generate_together", poisoned_generate_together)
    else:
        pipeline.execute.generate_together = poisoned_generate_together


if __name__ == "__main__":
    install()
    from pipeline.cli import cli

    cli(sys.argv[1:])
