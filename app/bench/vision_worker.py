"""One engine of `kvforge bench vision`, in a process of its own, run by that engine's interpreter:
`python vision_worker.py JOB_JSON`. Only the standard library at the top (a peer's virtualenv has no kvforge); the
parent copies this file into a scratch directory and runs it from there.

The job: kind (kvforge | hf | llama.cpp), model (a checkpoint directory, or a GGUF file), mmproj (llama.cpp: the
projector file), picture (a PNG), dtype, threads, question, answer, follow_up. Each engine answers the first turn
(the picture and the question) with one token, then the next turn (the first turn, the answer, the follow-up) with
one token; it prints one JSON line: the load time, each turn's seconds and prompt tokens, and what each engine says
of the picture (kvforge: the tower's runs; llama.cpp: none, its chat handler re-reads the picture every turn)."""

from __future__ import annotations

import base64
import json
import sys
import time

perf = time.perf_counter


def conversations(job: dict) -> tuple[list[dict], list[dict]]:
    """The two turns in HF's content-part form (the picture as {"type": "image"})."""
    first = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": job["question"]}]}]
    second = first + [{"role": "assistant", "content": [{"type": "text", "text": job["answer"]}]},
                      {"role": "user", "content": [{"type": "text", "text": job["follow_up"]}]}]
    return first, second


def run_kvforge(job: dict) -> dict:
    import io

    import torch
    from PIL import Image

    from kvforge.core import LLM, SamplingParams
    from kvforge.core.images import ImageInput

    torch.set_num_threads(job["threads"])
    data = open(job["picture"], "rb").read()
    picture = Image.open(io.BytesIO(data)).convert("RGB")
    start = perf()
    llm = LLM(job["model"], progress=False, dtype=job["dtype"], kv_cache_bytes=512 << 20)
    load = perf() - start
    tokenizer, params = llm.tokenizer, SamplingParams(temperature=0, max_tokens=1)
    turns = []
    for messages in conversations(job):
        start = perf()  # the processor's work counts, as in a served request
        prompt = tokenizer.encode_with_images(tokenizer.processor.apply_chat_template(messages,
                                                                                      add_generation_prompt=True),
                                              [picture], [ImageInput.digest_of(data)])
        [out] = llm.generate(prompt, params)
        turns.append({"seconds": perf() - start, "prompt_tokens": len(prompt.token_ids),
                      "cached_tokens": out.num_cached_tokens})
    encoded = llm.engine.runner.model.images_encoded
    llm.engine.close()
    return {"load_s": load, "turns": turns, "tower_runs": encoded}


def run_hf(job: dict) -> dict:
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(job["threads"])
    picture = Image.open(job["picture"]).convert("RGB")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job["dtype"]]
    start = perf()
    model = AutoModelForImageTextToText.from_pretrained(job["model"], dtype=dtype).eval()
    processor = AutoProcessor.from_pretrained(job["model"], backend="pil")
    load = perf() - start
    turns = []
    for messages in conversations(job):
        start = perf()
        text = processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = processor(text=[text], images=[[picture]], return_tensors="pt", add_special_tokens=False)
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=0)
        turns.append({"seconds": perf() - start, "prompt_tokens": int(inputs["input_ids"].shape[1]),
                      "cached_tokens": 0})
    return {"load_s": load, "turns": turns}


def run_llama_cpp(job: dict) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import MTMDChatHandler

    url = "data:image/png;base64," + base64.b64encode(open(job["picture"], "rb").read()).decode()
    start = perf()
    llm = Llama(model_path=job["model"], chat_handler=MTMDChatHandler(clip_model_path=job["mmproj"], verbose=False),
                n_ctx=4096, n_batch=2048, n_ubatch=2048, n_threads=job["threads"], n_threads_batch=job["threads"],
                verbose=False)
    load = perf() - start
    first = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": job["question"]}]}]
    second = first + [{"role": "assistant", "content": job["answer"]}, {"role": "user", "content": job["follow_up"]}]
    turns = []
    for messages in (first, second):
        start = perf()
        reply = llm.create_chat_completion(messages=messages, max_tokens=1, temperature=0)
        turns.append({"seconds": perf() - start, "prompt_tokens": reply["usage"]["prompt_tokens"],
                      "cached_tokens": None})
    import llama_cpp

    return {"load_s": load, "turns": turns, "version": llama_cpp.__version__}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    runner = {"kvforge": run_kvforge, "hf": run_hf, "llama.cpp": run_llama_cpp}[spec["kind"]]
    print(json.dumps(runner(spec)), flush=True)
