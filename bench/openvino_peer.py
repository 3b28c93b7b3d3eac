"""The OpenVINO GenAI peer on the same prompts: run by ``bench/memory_budget.py --peer-python``, in the peer's own venv.

Not imported by Velox (the peer is never a dependency): ``bench/memory_budget.py`` writes a
JSON request (the GGUF file, prompts as text with the chat template applied, ``max_tokens``,
the KV cache size in GiB, and the eviction budget or none) and runs this file with the
peer's interpreter; it prints one JSON line: load seconds, generate seconds, tokens made.
Greedy decoding; float32 compute and an f32 KV cache (the peer's CPU defaults are bf16 and
u8), so that both sides compute in the same precision. Set up the peer once:

    python3 -m venv /tmp/ovenv && /tmp/ovenv/bin/pip install openvino-genai
"""

from __future__ import annotations

import json
import sys
import time


def main(request_path: str) -> None:
    import openvino_genai as genai

    request = json.loads(open(request_path).read())
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = max(1, round(request["cache_gib"]))
    scheduler.max_num_seqs = request["max_rows"]
    scheduler.dynamic_split_fuse = True
    if request.get("eviction_budget"):
        budget = request["eviction_budget"]
        scheduler.use_cache_eviction = True
        scheduler.cache_eviction_config = genai.CacheEvictionConfig(
            start_size=32, recent_size=32, max_cache_size=budget + 64, aggregation_mode=genai.AggregationMode.NORM_SUM
        )
    properties = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "INFERENCE_NUM_THREADS": request["threads"]}
    start = time.perf_counter()
    pipeline = genai.ContinuousBatchingPipeline(request["gguf"], scheduler, "CPU", properties)
    loaded = time.perf_counter() - start
    config = genai.GenerationConfig()
    config.max_new_tokens = request["max_tokens"]
    config.do_sample = False
    config.apply_chat_template = False
    prompts = request["prompts"]
    start = time.perf_counter()
    results = pipeline.generate(prompts, [config] * len(prompts))
    seconds = time.perf_counter() - start
    texts = [result.texts[0] if hasattr(result, "texts") else result.m_generation_ids[0] for result in results]
    print(json.dumps({"load_seconds": loaded, "seconds": seconds, "documents": len(prompts), "texts": texts}))


if __name__ == "__main__":
    main(sys.argv[1])
