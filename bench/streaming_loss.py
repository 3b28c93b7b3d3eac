"""What streaming prefill forgets: the tokens prefill-end selection keeps that streaming had evicted, and when.

For each corpus document of ``bench/fidelity.py`` (prompted as the main job
prompts it), every policy runs twice at the same budget: ``prefill_end`` (the
whole prompt held, then the instruction's window selects) and ``streaming``
(a probe selects after every chunk). Per layer and KV head, the positions
prefill-end keeps are compared with what streaming holds when prefill ends.
Prints, per policy x budget: the share of prefill-end's kept tokens that
streaming also kept (``overlap``), and for the ones it lost, where it lost
them: at which probe (by the document's thirds, early to late) or at the final
selection by the instruction (``final``). Lost tokens that were never held
after any probe were evicted by the very probe that followed their chunk.

    python bench/streaming_loss.py --documents 8 --policies pyramidkv squeeze --fractions 0.5 0.25
    python bench/streaming_loss.py --documents 2 --set stream_headroom=2
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from bench.common import config_overrides, load_default_model  # noqa: E402
from bench.fidelity import corpus_prompts  # noqa: E402
from velox_cache import KVCacheBuilder, KVCacheConfig, observe, prefill_phases  # noqa: E402

CHUNK = 256  # the main job's prefill_step_size


def held_positions(cache) -> list:
    """Per KV head, the set of positions ``cache`` holds (pooled heads split by their head ids)."""
    slots = cache.slots
    positions = slots.held_positions()[0]  # [H, N] (uniform) or [1, N] (pooled)
    if not slots.heads_pooled:
        return [set(row) for row in positions.tolist()]
    found = [set() for _ in range(slots.kv_heads)]
    for head, position in zip(slots.held_heads().tolist(), positions[0].tolist()):
        found[head].add(position)
    return found


def prefill(model, prompt, config, after_call=None) -> list:
    caches = KVCacheBuilder.for_model(model, config, prompt_tokens=len(prompt.tokens))
    with observe(model):
        prefill_phases(
            model, caches, prefix=prompt.prefix, document=prompt.document, instruction=prompt.instruction,
            chunk_size=CHUNK, max_new_tokens=40, after_call=after_call,
        )
    return caches


def compare(model, prompt, fields: dict) -> tuple:
    """``(kept by prefill end, also kept by streaming, Counter of where streaming lost the rest)``."""
    reference = [held_positions(c) for c in prefill(model, prompt, KVCacheConfig(**fields, eviction="prefill_end"))]
    after_probe = []  # per probe: [layer][head] -> held positions

    def record(event, caches):
        if event == "probe_dropped":
            after_probe.append([held_positions(c) for c in caches])

    final = [held_positions(c) for c in prefill(model, prompt, KVCacheConfig(**fields, eviction="streaming"), record)]
    n_probes = max(1, len(after_probe))
    kept = overlap = 0
    lost = Counter()
    for layer, heads in enumerate(reference):
        for head, wanted in enumerate(heads):
            kept += len(wanted)
            overlap += len(wanted & final[layer][head])
            for position in wanted - final[layer][head]:
                held_after = [i for i, probe in enumerate(after_probe) if position in probe[layer][head]]
                # the probe that dropped it: the one after its last survival, or the one right after its chunk
                probe = held_after[-1] + 1 if held_after else position // CHUNK
                if probe >= len(after_probe):
                    lost["final"] += 1  # held after the last probe: the instruction's selection dropped it
                else:
                    lost[("early", "middle", "late")[min(2, 3 * probe // n_probes)]] += 1
    return kept, overlap, lost


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--policies", nargs="+", default=["pyramidkv", "squeeze"])
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.25])
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="extra KVCacheConfig fields")
    args = parser.parse_args(argv)
    extra = config_overrides(args.set)
    model, tokenizer = load_default_model()
    documents = corpus_prompts(tokenizer, count=args.documents, min_tokens=1000, max_tokens=4000)
    totals: dict = {}
    for name, prompt in documents:
        for policy in args.policies:
            for fraction in args.fractions:
                budget = max(8, int(len(prompt.tokens) * fraction))
                fields = dict(method=policy, budget=budget, scoring="observed", **extra)
                kept, overlap, lost = compare(model, prompt, fields)
                total = totals.setdefault((policy, fraction), [0, 0, Counter()])
                total[0] += kept
                total[1] += overlap
                total[2].update(lost)
                mx.clear_cache()
        print(f"# {name}: {len(prompt.tokens)} prompt tokens", flush=True)
    print(f"\nStreaming against prefill-end selection, {len(documents)} documents {' '.join(args.set)}\n")
    print("| policy | budget | overlap | lost early | lost middle | lost late | lost at the final selection |")
    print("|---|---|---|---|---|---|---|")
    for (policy, fraction), (kept, overlap, lost) in totals.items():
        missing = max(1, kept - overlap)
        shares = " | ".join(f"{lost[k] / missing:.0%}" for k in ("early", "middle", "late", "final"))
        print(f"| {policy} | {fraction:.0%} | {overlap / kept:.3f} | {shares} |")


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()
    main()
