"""``velox-batch``: a thin Click layer over the pipeline's Python API."""

from __future__ import annotations

import click

from . import model_store


@click.group()
@click.version_option(package_name="velox")
def cli():
    """Velox batch jobs: KV-cache-compressed LLM runs with a queryable SQLite store.

    \b
    Example:
        velox-batch run jobs/summarize.yaml
    """


@cli.group()
def models():
    """Import and list models (GGUF files become mlx-lm model directories).

    \b
    Example:
        velox-batch models import
        velox-batch models list
    """


@models.command("import")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
def models_import(path):
    """Import a GGUF file (default: the embedded SmolLM2) into the model cache.

    Idempotent: a model imported before is reused.

    \b
    Example:
        velox-batch models import ~/Downloads/model.Q4_1.gguf
    """
    try:
        directory = model_store.import_model(path)
    except model_store.ModelImportError as exc:
        raise click.ClickException(str(exc))
    click.echo(str(directory))


@models.command("list")
def models_list():
    """List imported models, their directories and sizes.

    \b
    Example:
        velox-batch models list
    """
    found = model_store.list_models()
    if not found:
        click.echo(f"no models imported in {model_store.models_dir()}")
    for model in found:
        click.echo(f"{model.name}\t{model.size_bytes / 2**20:.1f} MiB\t{model.path}")


@cli.command()
def doctor():
    """Show MLX version and device, BLAS and its measured GEMM speed, and the model cache.

    \b
    Example:
        velox-batch doctor
    """
    from .doctor import diagnose

    report = diagnose()
    width = max(len(name) for name, _ in report.facts)
    for name, value in report.facts:
        click.echo(f"{name:<{width}}  {value}")
    for line in report.advice:
        click.echo(f"! {line}")


def main():
    """Console-script entry point: preload a fast BLAS where available, then run the CLI."""
    from .platform import ensure_fast_blas

    ensure_fast_blas()
    cli()


if __name__ == "__main__":
    main()
