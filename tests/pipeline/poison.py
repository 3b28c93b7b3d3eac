"""A decode failure injected for one document's full variant: a decode whose rows include it raises.

Its rows are the full variant's rows whose prompt holds ``POISON``: decoding one alone
raises too, decoding any other row alone does not. Run as a
script, it is ``velox-batch`` with the injection in place (for tests that kill the process).
"""

import sys

import pipeline.execute

MARK = "POISON"
_original = pipeline.execute.generate_together


def poisoned_generate_together(model, tokenizer, runs, **options):
    if any(run.config.method == "full" and MARK in tokenizer.decode(run.row.sampler.prompt) for run in runs):
        raise RuntimeError("injected: a poisoned row")
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
