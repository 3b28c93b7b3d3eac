"""Sweep: every architecture of mlx-lm's own model tests, with Velox's caches in place of mlx-lm's.

mlx-lm's ``tests/test_models.py`` builds a tiny instance of every architecture
it supports and runs prefill and decode through ``make_prompt_cache(model)``
(its ``model_test_runner``). This script reads that file at run time (it is
not part of this repository), runs each of its model tests with the runner
replaced by one that, per architecture:

1. runs mlx-lm's runner unchanged (``plain``: passes with mlx-lm's caches?);
2. runs mlx-lm's runner with ``make_prompt_cache`` answered by
   ``KVCacheBuilder.for_model`` for each policy (default budget);
3. compares logits with plain mlx-lm caches over a chunked prefill and
   teacher-forced decode, with a budget covering the sequence, for the key
   proxy (under mlx-lm's attention and inside ``fast_attention``, as
   ``velox-batch`` runs it) and for observed scoring (they must be equal);
4. runs the same sequence with a small budget and checks that every
   compressed layer keeps at most its budget.

It prints one row per architecture: passes with plain, passes with Velox per
policy, and how much of the model Velox compresses (``full``, ``partly`` for
hybrids, ``refused`` with the reason).

    git clone https://github.com/ml-explore/mlx-lm /tmp/mlx-lm
    python bench/architectures.py /tmp/mlx-lm            # or the path of tests/test_models.py
    python bench/architectures.py /tmp/mlx-lm --only gemma3_text gpt_oss --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import inspect
import json
import subprocess
import sys
import tempfile
import traceback
import unittest
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import velox_cache  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig  # noqa: E402
from velox_cache.cache.accounting import CacheAccounting  # noqa: E402
from velox_cache.cache.model_caches import UnsupportedModelError, cache_kind  # noqa: E402

POLICIES = ("pyramidkv", "squeeze")
# "fast": the key proxy inside velox_cache.fast_attention (Velox's attention for every layer, as velox-batch runs)
SCORINGS = ("key_proxy", "fast", "observed")
PROMPT_TOKENS, DECODE_TOKENS, CHUNK = 24, 6, 7
SMALL_BUDGET, SMALL_SINK = 8, 2
TOLERANCE = 1e-4
# mlx-lm builds a few architectures at full size (its runner never evaluates them); evaluating
# those here would need tens of GB, so they are checked on a copy with these sizes instead.
MAX_PARAMETERS = 500_000_000
SHRUNK = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
              num_hidden_layers=4, vocab_size=1000, head_dim=32, kv_channels=32)


@dataclass
class ArchitectureResult:
    test: str
    model_type: str
    plain: str = "-"
    velox: dict = field(default_factory=dict)  # policy -> "pass" or the failure
    kinds: str = ""
    coverage: str = ""  # "full", "partly" or "refused"
    compressed: str = ""  # "3/4"
    notes: list = field(default_factory=list)
    stage: str = "start"  # what was running, for a crash report

    @property
    def passes_everywhere(self) -> bool:
        passed = all(v.startswith("pass") for v in self.velox.values())
        return self.plain != "pass" or self.coverage == "refused" or passed


def plain_evaluated(model, vocab_size: int):
    """mlx-lm's runner steps with mlx-lm's caches, evaluated (its runner only checks shapes); None or the error."""
    try:
        for dtype in (mx.float32, mx.float16):
            model.update(tree_map(lambda p: p.astype(dtype), model.parameters()))
            cache = make_prompt_cache(model)
            outputs = model(mx.array([[0, 1]]), cache=cache)
            outputs = model(mx.argmax(outputs[0, -1:, :], keepdims=True), cache=cache)
            mx.eval(outputs)
        return None
    except Exception as exc:  # noqa: BLE001
        return _describe(exc)
    finally:
        model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))


def velox_layers(caches) -> list:
    """The Velox caches of a cache list, also those inside a ``CacheList``."""
    found = []
    for cache in caches:
        members = getattr(cache, "caches", None)
        for member in members if members is not None else [cache]:
            if isinstance(member, CacheAccounting):
                found.append(member)
    return found


def attention_context(model, scoring: str):
    """``observe`` for observed scoring, ``fast_attention`` for ``fast``, else mlx-lm's own attention."""
    if scoring == "observed":
        return velox_cache.observe(model)
    if scoring == "fast":
        return velox_cache.fast_attention(model)
    return contextlib.nullcontext()


def cache_scoring(scoring: str) -> str:
    """The caches' ``scoring`` for one of ``SCORINGS``."""
    return "observed" if scoring == "observed" else "key_proxy"


def run_sequence(model, tokens: mx.array, caches, *, chunk: int, scoring: str) -> list:
    """Chunked prefill of all but the prompt's last token, then one token per call; the logits of every call.

    ``scoring`` (one of ``SCORINGS``) picks the attention the model runs on (``attention_context``).
    """
    context = attention_context(model, scoring)
    outputs = []
    with context:
        for start in range(0, PROMPT_TOKENS - 1, chunk):
            outputs.append(model(tokens[None, start : min(start + chunk, PROMPT_TOKENS - 1)], cache=caches)[:, -1])
            mx.eval(outputs[-1], [c.state for c in caches])
        for position in range(PROMPT_TOKENS - 1, tokens.size):
            outputs.append(model(tokens[None, position : position + 1], cache=caches)[:, -1])
            mx.eval(outputs[-1])
    return outputs


def max_difference(expected: list, got: list) -> float:
    return max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() for a, b in zip(expected, got))


def check_velox(model, tokens: mx.array, method: str, scoring: str, expected: list) -> list[str]:
    """Problems found with ``method``/``scoring`` on ``model``: logits at full budget, budgets when small."""
    problems = []
    total = tokens.size
    # Pyramid and squeeze give some layers less than the average: 4x the length covers every layer.
    config = KVCacheConfig(method=method, budget=4 * total, scoring=cache_scoring(scoring))
    caches = KVCacheBuilder.for_model(model, config)
    got = run_sequence(model, tokens, caches, chunk=CHUNK, scoring=scoring)
    difference = max_difference(expected, got)
    scale = max(1.0, max(mx.abs(e).max().item() for e in expected))
    if not difference <= TOLERANCE * scale:
        problems.append(f"{scoring}: logits differ from plain by {difference:.2e} at full budget")
    config = KVCacheConfig(method=method, budget=SMALL_BUDGET, n_sink=SMALL_SINK, scoring=cache_scoring(scoring))
    caches = KVCacheBuilder.for_model(model, config)
    run_sequence(model, tokens, caches, chunk=CHUNK, scoring=scoring)
    layers = velox_layers(caches)
    over = [c.layer_id for c in layers if c.tokens_kept > c.layer_budget]
    if over:
        problems.append(f"{scoring}: layers {over} keep more than their budget")
    if sum(c.layer_budget for c in layers) != SMALL_BUDGET * len(layers):
        problems.append(f"{scoring}: budgets do not average {SMALL_BUDGET} over the compressed layers")
    return problems


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


def shrink(model):
    """The same architecture with ``SHRUNK`` sizes for the fields its ``ModelArgs`` has."""
    args = model.args
    values = dataclasses.asdict(args)
    values.update({k: v for k, v in SHRUNK.items() if k in values})
    architecture = sys.modules[type(model).__module__]
    return architecture.Model(architecture.ModelArgs.from_dict(values))


def check_architecture(module, test_case, model, model_type, vocab_size, num_layers, save,
                       skip_sequence=False) -> ArchitectureResult:
    result = ArchitectureResult(test=test_case._testMethodName, model_type=model_type)
    original_runner = module.TestModels.model_test_runner
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    if parameters > MAX_PARAMETERS:
        try:
            model = shrink(model)
        except Exception as exc:  # noqa: BLE001
            result.notes.append(f"not run: {parameters / 1e6:.0f}M parameters, and shrinking failed ({_describe(exc)})")
            return result
        vocab_size, num_layers = model.args.vocab_size, len(model.layers)
        result.notes.append(f"checked on a shrunk copy ({SHRUNK['hidden_size']} wide, {num_layers} layers): "
                            f"mlx-lm's test builds it with {parameters / 1e6:.0f}M parameters")
    result.stage = "plain: mlx-lm runner"
    save(result)
    try:
        original_runner(test_case, model, model_type, vocab_size, num_layers)
        result.plain = "pass"
    except Exception as exc:  # noqa: BLE001 - the sweep records every failure
        result.plain = _describe(exc)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    plain_caches = make_prompt_cache(model)
    counts = Counter(cache_kind(c) for c in plain_caches)
    result.kinds = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    mx.random.seed(0)
    tokens = mx.random.randint(0, vocab_size, (PROMPT_TOKENS + DECODE_TOKENS,))
    result.stage = "plain: chunked prefill and decode"
    save(result)
    expected = None
    if skip_sequence:
        result.notes.append("chunked prefill crashed the process with mlx-lm's own caches: mlx-lm runner only")
    else:
        try:
            expected = run_sequence(model, tokens, plain_caches, chunk=CHUNK, scoring="key_proxy")
        except Exception as exc:  # noqa: BLE001
            result.notes.append(f"plain sequence run failed: {_describe(exc)}")
    for method in POLICIES:
        result.stage = f"velox: {method}"
        result.velox[method] = "crashed"
        save(result)
        result.velox[method] = _check_policy(module, test_case, model, model_type, vocab_size, num_layers,
                                             method, tokens, expected, result)
    result.stage = "done"
    save(result)
    return result


def _check_policy(module, test_case, model, model_type, vocab_size, num_layers, method, tokens, expected, result):
    try:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method))
    except UnsupportedModelError as exc:
        result.coverage = "refused"
        result.kinds = str(exc).split(": ", 1)[-1]  # the reason, which names the kinds
        return "refused"
    except Exception as exc:  # noqa: BLE001
        return f"for_model: {_describe(exc)}"
    velox = velox_layers(caches)
    result.compressed = f"{len(velox)}/{len(caches)}"
    result.coverage = "full" if all(isinstance(c, CacheAccounting) for c in caches) else "partly"
    factory = lambda _model, *args, **kwargs: KVCacheBuilder.for_model(_model, KVCacheConfig(method=method))  # noqa: E731
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with mock.patch.object(module, "make_prompt_cache", factory):
                module.TestModels.model_test_runner(test_case, model, model_type, vocab_size, num_layers)
        except Exception as exc:  # noqa: BLE001
            plain_error = plain_evaluated(model, vocab_size)
            if plain_error is None:
                problems.append(f"mlx-lm runner: {_describe(exc)}")
            else:
                note = f"mlx-lm runner fails in plain mlx-lm too once its outputs are evaluated ({plain_error})"
                if note not in result.notes:
                    result.notes.append(note)
        model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
        if expected is not None:
            for scoring in SCORINGS:
                try:
                    problems += check_velox(model, tokens, method, scoring, expected)
                except velox_cache.ObservationError:
                    note = "not observable (attention written by hand): no observe or fast_attention, key proxy only"
                    if note not in result.notes:
                        result.notes.append(note)
                except Exception as exc:  # noqa: BLE001
                    problems.append(f"{scoring}: {_describe(exc)}")
    fallbacks = {str(w.message).split(":")[0] for w in caught if issubclass(w.category, RuntimeWarning)}
    if fallbacks:
        note = f"observed: {len(fallbacks)} layer(s) not observable, scored by key proxy"
        if note not in result.notes:
            result.notes.append(note)
    if problems:
        return "; ".join(problems)
    return "pass" if expected is not None else "pass (runner only)"


def load_mlx_tests(path: Path):
    """Import mlx-lm's ``tests/test_models.py`` from a checkout directory or the file itself."""
    path = Path(path)
    if path.is_dir():
        path = path / "tests" / "test_models.py"
    if not path.is_file():
        raise SystemExit(f"no mlx-lm model tests at {path}")
    spec = importlib.util.spec_from_file_location("mlx_lm_test_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_tests(module) -> list[str]:
    """The test methods that build a model and hand it to ``model_test_runner``."""
    return [
        name
        for name, function in inspect.getmembers(module.TestModels, inspect.isfunction)
        if name.startswith("test_") and "model_test_runner(" in inspect.getsource(function)
    ]


def run_test(module, name: str, out: Path, only=None, skip_sequence=False) -> None:
    """Run one of mlx-lm's model tests with the sweep's runner; results go to ``out`` (JSON) as they come."""
    results: list[ArchitectureResult] = []

    def save(current=None):
        rows = results + ([current] if current is not None and all(current is not r for r in results) else [])
        out.write_text(json.dumps([asdict(r) for r in rows]))

    class Sweep(module.TestModels):
        def model_test_runner(self, model, model_type, vocab_size, num_layers):
            if only and model_type not in only:
                return
            results.append(check_architecture(module, self, model, model_type, vocab_size, num_layers, save,
                                              skip_sequence=skip_sequence))

    outcome = unittest.TestResult()
    Sweep(name).run(outcome)
    for _, reason in outcome.skipped:  # mlx-lm's own test skips (a missing optional package)
        if only and name.removeprefix("test_") not in only:
            continue
        results.append(ArchitectureResult(test=name, model_type=name.removeprefix("test_"),
                                          plain=f"skipped by mlx-lm's test: {reason}", stage="done"))
    save()
    for _, trace in outcome.errors:
        if "model_test_runner" not in trace:
            print(f"  {name}: outside the runner: {trace.strip().splitlines()[-1][:160]}", file=sys.stderr)


def sweep(tests_path: Path, module, only=None) -> list[ArchitectureResult]:
    """Every model test in its own process (a crash in MLX loses one architecture, not the sweep)."""
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in model_tests(module):
            out = Path(scratch) / f"{name}.json"
            command = [sys.executable, __file__, str(tests_path), "--run-test", name, "--out", str(out)]
            if only:
                command += ["--only", *sorted(only)]
            crashes = 0
            for _ in range(3):  # MLX itself crashes intermittently on some models (phi3small)
                finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                sys.stderr.write(finished.stderr)
                if finished.returncode == 0 or not out.exists():
                    break
                crashes += 1
            rows = [ArchitectureResult(**row) for row in json.loads(out.read_text())] if out.exists() else []
            if finished.returncode != 0 and rows and rows[-1].stage == "plain: chunked prefill and decode":
                finished = subprocess.run(command + ["--skip-sequence"], stdout=subprocess.DEVNULL)
                rows = [ArchitectureResult(**row) for row in json.loads(out.read_text())]
            if not rows and finished.returncode != 0:  # no model built (a missing optional package, say)
                reason = (finished.stderr.strip().splitlines() or ["no output"])[-1][:160]
                rows = [ArchitectureResult(test=name, model_type=name.removeprefix("test_"),
                                           plain=f"not run: {reason}", stage="done")]
            if crashes and rows:
                rows[-1].notes.append(f"the process crashed {crashes} time(s)")
            if finished.returncode != 0 and rows and rows[-1].stage != "done":
                rows[-1].notes.append(f"process died (status {finished.returncode}) during {rows[-1].stage}")
                if rows[-1].stage.startswith("plain"):
                    rows[-1].plain = rows[-1].plain if rows[-1].plain != "-" else "crashed"
            for row in rows:
                print(f"  {row.model_type}: plain {row.plain}; "
                      + "; ".join(f"{k} {v}" for k, v in row.velox.items()), file=sys.stderr, flush=True)
            results += rows
    return results


def format_table(results: list[ArchitectureResult], *, markdown: bool) -> str:
    header = ["architecture", "plain", *POLICIES, "compressed", "layers", "mlx-lm caches / why refused", "notes"]
    rows = []
    for r in sorted(results, key=lambda r: r.model_type):
        cells = [r.model_type, r.plain, *(r.velox.get(p, "-") for p in POLICIES), r.coverage, r.compressed,
                 r.kinds, "; ".join(r.notes)]
        rows.append([c.replace("|", "/") for c in cells])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    return "\n".join("\t".join(row) for row in [header] + rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mlx_lm", type=Path, help="an mlx-lm checkout, or the path of its tests/test_models.py")
    parser.add_argument("--only", nargs="*", help="model types to check (default: all)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--run-test", help=argparse.SUPPRESS)  # one test, in a child process
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--skip-sequence", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    module = load_mlx_tests(args.mlx_lm)
    if args.run_test:
        run_test(module, args.run_test, args.out, only=set(args.only or []), skip_sequence=args.skip_sequence)
        return 0
    results = sweep(args.mlx_lm, module, only=set(args.only or []))
    print(format_table(results, markdown=args.markdown))
    failing = [r.model_type for r in results if not r.passes_everywhere]
    print(f"\n{len(results)} architectures; passing with plain but failing with Velox: {failing or 'none'}",
          file=sys.stderr)
    return 1 if failing else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # pragma: no cover
        traceback.print_exc()
        sys.exit(2)
