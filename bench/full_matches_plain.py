"""Does the main job's ``full`` variant say exactly what plain mlx-lm says?

For the first ``--documents`` documents of a job spec (default: the main job),
builds each prompt as the runner does, generates greedily with the runner's own
``generate`` and the Velox ``full`` cache (Velox's attention kernel on the CPU
backend), and with plain ``mlx_lm.generate_step`` (mlx-lm's ``KVCache``, fused
attention, no Velox context), and prints whether the token ids are identical.
Exit status 1 if any document differs. Not a timing benchmark.

    python bench/full_matches_plain.py --documents 10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_lm.generate import generate_step  # noqa: E402

from pipeline.generation import generate  # noqa: E402
from pipeline.model_store import context_length, load_model  # noqa: E402
from pipeline.prompting import PromptTooLong, build_prompt  # noqa: E402
from pipeline.source import iter_documents, open_dataset  # noqa: E402
from pipeline.spec import load_spec  # noqa: E402
from velox_cache import KVCacheConfig  # noqa: E402


def plain_greedy(model, prompt_tokens, *, max_tokens, step, eos) -> list[int]:
    import mlx.core as mx

    out = []
    for token, _ in generate_step(mx.array(prompt_tokens), model, max_tokens=max_tokens, prefill_step_size=step):
        token = int(token)
        if token in eos:
            break
        out.append(token)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default="jobs/summarize.yaml")
    parser.add_argument("--documents", type=int, default=10)
    args = parser.parse_args(argv)

    spec = load_spec(args.spec)
    model, tokenizer = load_model(spec.model)
    context = context_length(model)
    settings = spec.generation
    eos = set(tokenizer.eos_token_ids)
    differing = 0
    checked = 0
    for document in iter_documents(spec, open_dataset(spec)):
        if checked == args.documents:
            break
        try:
            prompt = build_prompt(spec, tokenizer, document, context_length=context)
        except PromptTooLong:
            print(f"{document.document_id}: skipped (longer than the context)")
            continue
        checked += 1
        velox = generate(model, tokenizer, prompt, KVCacheConfig(method="full"), settings).token_ids
        plain = plain_greedy(model, prompt.tokens, max_tokens=settings.max_tokens, step=settings.prefill_step_size, eos=eos)
        same = velox == plain
        differing += not same
        first = next((i for i, (a, b) in enumerate(zip(velox, plain)) if a != b), min(len(velox), len(plain)))
        detail = "identical" if same else f"differ from token {first}"
        print(f"{document.document_id}: {len(prompt.tokens)} prompt tokens, {len(velox)} output tokens, {detail}",
              flush=True)
    print(f"\n{checked - differing} of {checked} documents identical to plain mlx-lm")
    return 1 if differing else 0


if __name__ == "__main__":
    from pipeline.platform import ensure_fast_blas

    ensure_fast_blas()  # OpenBLAS preloaded, its kernels chosen from the CPU (re-executes once)
    sys.exit(main())
