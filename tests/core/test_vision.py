"""The vision-language families (Idefics3 / SmolVLM: core/models/idefics3.py; Gemma 3: core/models/gemma3_vision.py,
whose image tokens attend to each other both ways) against HF transformers on tiny random ones: every prompt
position's log-probability with one and with several images, greedy tokens batched with text-only prompts across
chunked prefills (Gemma 3's with a budget smaller than an image: the image goes in one chunk) and preemption, each
image encoded once per request, and the prefix cache and the persisted KV keying an image's positions by its content
(core/images.py)."""

from __future__ import annotations

import pytest
import torch

from kvforge.core import LLM, SamplingParams
from kvforge.core.images import EncodedImages, ImageInput, ImagePrompt
from tests.helpers.tiny_models import save_tiny_idefics3
from tests.helpers.vision import (
    FAMILIES,
    NEW_TOKENS,
    TEXT_AFTER,
    assert_prompt_logprobs_match_hf,
    family_of,
    hf_generate,
    hf_inputs,
    picture,
    prompt_of,
    user,
)


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, tmp_path_factory, embedded_path):
    build = FAMILIES[request.param][0]
    path = tmp_path_factory.mktemp(request.param)
    model, processor = build(path, embedded_path, seed=5)
    return path, model, processor


def test_every_prompt_position_matches_hf_with_one_and_with_several_images(vlm):
    """The log-probability of each prompt token after the ones before it (image positions included) within 1e-4 of
    HF's, a picture split into tiles with a global view and one small enough for a single tile."""
    path, model, processor = vlm
    cases = [(user(processor, "<image>" + TEXT_AFTER), [picture(1, 50, 70)]),
             (user(processor, "<image> and <image> side by side." + TEXT_AFTER),
              [picture(2, 64, 40), picture(3, 20, 30)])]
    llm = LLM(str(path), progress=False, dtype="float32", num_kv_blocks=64)
    try:
        for text, pictures in cases:
            prompt = prompt_of(processor, text, pictures)
            inputs = hf_inputs(processor, text, pictures)
            assert prompt.token_ids == inputs["input_ids"][0].tolist()
            assert_prompt_logprobs_match_hf(llm, prompt, model, inputs)
    finally:
        llm.engine.close()


def test_batched_with_text_prompts_chunked_and_preempted_it_gives_hfs_tokens_encoding_each_image_once(vlm):
    path, model, processor = vlm
    cases = [(user(processor, "<image>" + TEXT_AFTER), [picture(4, 60, 60)]),
             ("A text-only question about the weather in spring.", []),
             (user(processor, "<image> then <image>." + TEXT_AFTER), [picture(5, 33, 64), picture(6, 64, 64)]),
             ("Another plain prompt" + TEXT_AFTER, [])]
    prompts = [prompt_of(processor, text, pictures) for text, pictures in cases]
    reference = [hf_generate(model, hf_inputs(processor, text, pictures)) for text, pictures in cases]
    # chunks that would end inside images; the blocks cannot hold the batch: sequences are preempted
    _, _, budget, blocks = FAMILIES[family_of(processor)]
    llm = LLM(str(path), progress=False, dtype="float32", block_size=16, num_kv_blocks=blocks,
              max_num_batched_tokens=budget, enable_prefix_caching=False)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert llm.engine.stats().preemptions_total > 0
        assert [o.token_ids for o in outs] == reference
        assert llm.engine.runner.model.images_encoded == 3  # once per image, preempted or not
    finally:
        llm.engine.close()


def test_the_next_turn_reuses_the_images_blocks_and_another_image_never_does(vlm):
    """A follow-up turn repeating the picture hits the cache through the image and encodes nothing; the same
    prompt with another picture (the same token ids) hits only the text before the image, and gets HF's tokens for
    its own picture -- with the placeholder ids as keys it would read the first picture's KV."""
    path, model, processor = vlm
    first, other = picture(7, 64, 48), picture(8, 64, 48)
    text = user(processor, "<image>" + TEXT_AFTER)
    llm = LLM(str(path), progress=False, dtype="float32", block_size=16, num_kv_blocks=128)
    try:
        [turn] = llm.generate(prompt_of(processor, text, [first]), SamplingParams(temperature=0, max_tokens=8))
        model_ours = llm.engine.runner.model
        assert model_ours.images_encoded == 1
        follow_text = text + processor.tokenizer.decode(turn.token_ids) + " And the corners?"
        follow = prompt_of(processor, follow_text, [first])
        last_image_position = follow.images[0].positions[-1]
        [again] = llm.generate(follow, SamplingParams(temperature=0, max_tokens=4))
        assert again.num_cached_tokens > last_image_position
        assert model_ours.images_encoded == 1  # every image position came from the cache

        swapped = prompt_of(processor, text, [other])
        assert swapped.token_ids == prompt_of(processor, text, [first]).token_ids
        [out] = llm.generate(swapped, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert out.num_cached_tokens <= swapped.images[0].positions[0]
        assert model_ours.images_encoded == 2
        assert out.token_ids == hf_generate(model, hf_inputs(processor, text, [other]))
    finally:
        llm.engine.close()


def test_a_restarted_engine_reads_the_image_turn_from_the_persisted_kv(vlm, tmp_path):
    path, model, processor = vlm
    pictures = [picture(9, 40, 64)]
    text = user(processor, "<image>" + TEXT_AFTER)
    config = dict(progress=False, dtype="float32", block_size=16, num_kv_blocks=64, persist_kv=True,
                  data_dir=str(tmp_path), db_url=f"sqlite:///{tmp_path / 'kv.db'}")
    outputs = []
    for _ in range(2):
        llm = LLM(str(path), **config)
        try:
            prompt = prompt_of(processor, text, pictures)
            outputs += llm.generate(prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
            encoded = llm.engine.runner.model.images_encoded
        finally:
            llm.engine.close()
    first, restarted = outputs
    assert first.num_cached_tokens == 0
    assert restarted.num_cached_tokens > prompt.images[0].positions[-1]
    assert encoded == 0  # the restarted engine never ran the tower: the image's blocks came from disk
    assert restarted.token_ids == first.token_ids == hf_generate(model, hf_inputs(processor, text, pictures))


def test_prompts_whose_images_do_not_fit_their_tokens_are_refused(vlm, embedded_path):
    path, _, processor = vlm
    prompt = prompt_of(processor, user(processor, "<image> look."), [picture(10, 32, 32)])
    image = prompt.images[0]
    llm = LLM(str(path), progress=False, dtype="float32", num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="image tokens but no images"):
            llm.engine.add_request(prompt.token_ids, SamplingParams(max_tokens=1))
        moved = ImageInput([p - 1 for p in image.positions], image.pixels, image.digest)
        with pytest.raises(ValueError, match="is not an image token"):
            llm.engine.add_request(ImagePrompt(prompt.token_ids, [moved]), SamplingParams(max_tokens=1))
        half = ImageInput(image.positions[:4], image.pixels, image.digest)
        with pytest.raises(ValueError, match="image tokens; its images fill 4"):
            llm.engine.add_request(ImagePrompt(prompt.token_ids, [half]), SamplingParams(max_tokens=1))
        assert not llm.engine.has_unfinished()
    finally:
        llm.engine.close()
    with pytest.raises(ValueError, match="runs in one process"):
        LLM(str(path), progress=False, dtype="float32", pp_size=2)
    text_only = LLM(str(embedded_path), progress=False, num_kv_blocks=16)
    try:
        with pytest.raises(ValueError, match="takes no images"):
            text_only.engine.add_request(ImagePrompt([1, 2, 3], [image]), SamplingParams(max_tokens=1))
    finally:
        text_only.engine.close()


def test_encoded_images_keep_the_latest_pictures_within_their_budget():
    rows = {name: torch.zeros(4, 8) for name in (b"a", b"b", b"c")}  # 128 bytes each
    encoded = EncodedImages(budget_bytes=256)
    encoded.put(b"a", rows[b"a"])
    encoded.put(b"b", rows[b"b"])
    assert encoded.get(b"a") is rows[b"a"]  # a is now the latest used: b goes first
    encoded.put(b"c", rows[b"c"])
    assert encoded.get(b"b") is None and encoded.get(b"a") is rows[b"a"] and encoded.get(b"c") is rows[b"c"]
    assert encoded.bytes == 256
    encoded.put(b"d", torch.zeros(100, 8))  # larger than the whole budget: not kept, nothing dropped
    assert encoded.get(b"d") is None and encoded.bytes == 256


def test_the_memory_estimate_and_the_dashboard_count_the_vision_tower(vlm):
    from types import SimpleNamespace

    from kvforge.core.estimate import estimate_memory
    from kvforge.core.loader import load_config
    from kvforge.ui.dashboard import DashboardSampler, dashboard_markdown, human_bytes

    path, _, _ = vlm
    llm = LLM(str(path), progress=False, dtype="float32", num_kv_blocks=16)
    try:
        runner, model = llm.engine.runner, llm.engine.runner.model
        estimate = estimate_memory(load_config(path), "float32", 1024)
        tower = sum(runner.weight_bytes(getattr(model, part)) for part in model.vision_modules)
        assert estimate["vision_bytes"] == tower
        assert abs(estimate["weights_bytes"] - runner.weight_bytes()) <= 0.01 * runner.weight_bytes()
        (stage,) = llm.engine.runtime().stages
        assert stage["vision_bytes"] == estimate["vision_bytes"]
        sampler = DashboardSampler(SimpleNamespace(engine=llm.engine, name="tiny-vlm"))
        text = dashboard_markdown(SimpleNamespace(latest_sample=sampler.sample, recent_ttfts=list))
        assert f"| Vision tower | {human_bytes(stage['vision_bytes'])} on cpu |" in text
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def vlm_gguf(tmp_path_factory, embedded_path):
    """The tiny model (plain rope: transformers' GGUF reader ignores rope_freqs) as llama.cpp's file pair, beside a
    text-only GGUF of the same width whose vocabulary has no image token."""
    from kvforge.app.bench.hf_to_gguf import write_smolvlm_gguf_pair
    from tests.helpers.hostile_files import tiny_gguf

    model, processor = save_tiny_idefics3(tmp_path_factory.mktemp("idefics3-plain"), embedded_path, seed=6,
                                          plain_rope=True)
    directory = tmp_path_factory.mktemp("gguf-pair")
    text, mmproj = write_smolvlm_gguf_pair(model, processor, directory, mmproj_f16=True)
    tiny_gguf(directory / "plain.gguf")
    for name, values in model.named_parameters():  # the reference holds what the F16 projector holds
        if ("vision_model." in name or "connector." in name) and values.dim() == 2 and "embeddings" not in name:
            values.data.copy_(values.data.half().float())
    return directory, text, mmproj, model, processor


def test_a_gguf_with_its_mmproj_beside_it_reads_pictures_as_hf(vlm_gguf):
    """The projector found beside the model (llama.cpp's pair, its matrices F16), its tower and processor made from
    its metadata: the same token ids and pixels as HF's processor, every prompt position's log-probability within
    1e-4 of HF's; the models directory lists the model with the projector's bytes and not the projector itself; a
    text-only file of the same width is not paired."""
    from kvforge.app.models.catalog import describe, model_names
    from kvforge.core.gguf_mmproj import projector_for

    directory, text_file, mmproj, model, processor = vlm_gguf
    assert projector_for(text_file) == mmproj and projector_for(directory / "plain.gguf") is None
    llm = LLM(str(text_file), progress=False, dtype="float32", num_kv_blocks=64)
    try:
        assert llm.engine.config.quant == "gguf" and llm.tokenizer.takes_images
        text = "User:<image> and <image> side by side." + TEXT_AFTER
        pictures = [picture(11, 64, 40), picture(12, 20, 30)]
        prompt = llm.tokenizer.encode_with_images(text, [image for image, _ in pictures],
                                                  [ImageInput.digest_of(data) for _, data in pictures])
        inputs = hf_inputs(processor, text, pictures)
        assert prompt.token_ids == inputs["input_ids"][0].tolist()
        ours_pixels = torch.cat([image.pixels["pixel_values"] for image in prompt.images])
        torch.testing.assert_close(ours_pixels, inputs["pixel_values"][0], atol=0, rtol=0)
        assert_prompt_logprobs_match_hf(llm, prompt, model, inputs)
    finally:
        llm.engine.close()
    names = model_names(directory)
    assert text_file.name in names and "plain.gguf" in names and mmproj.name not in names
    tower = sum(p.numel() for n, p in model.named_parameters() if "vision_model." in n or "connector." in n)
    alone = describe("x", directory / "plain.gguf", 256)
    paired = describe("y", text_file, 256, dtype="float32")
    assert alone.error is None and paired.error is None
    assert paired.parameters == sum(p.numel() for p in model.parameters())
    assert paired.parameters - tower == sum(p.numel() for n, p in model.named_parameters()
                                            if not ("vision_model." in n or "connector." in n))


def test_a_gemma3_gguf_with_its_mmproj_reads_pictures_as_hf(tmp_path_factory, embedded_path, gemma_gguf_path):
    """Gemma 3 as llama.cpp's file pair (the decoder with Gemma's own vocabulary from the real 270M file, its norms
    stored as 1 + weight; the projector's matrices F16, its norm as 1 + weight, the pooling scale in its metadata):
    paired, the image tokens named in the index's tokenizer, HF's token ids and pixels, every prompt position's
    log-probability within 1e-4 of HF's."""
    from kvforge.app.bench.hf_to_gguf import write_gemma3_gguf_pair
    from tests.helpers.tiny_models import save_tiny_gemma3_vision

    model, processor = save_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3-gguf-shape"), embedded_path, seed=6,
                                               gemma_gguf=gemma_gguf_path)
    text_file, mmproj = write_gemma3_gguf_pair(model, processor, gemma_gguf_path, tmp_path_factory.mktemp("pair"))
    for name, values in model.named_parameters():  # the reference holds what the F16 projector holds
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) and values.dim() == 2 \
                and "embeddings" not in name:
            values.data.copy_(values.data.half().float())
    llm = LLM(str(text_file), progress=False, dtype="float32", num_kv_blocks=64)
    try:
        assert llm.engine.config.quant == "gguf" and llm.tokenizer.takes_images
        text = user(processor, "<image> and <image> side by side." + TEXT_AFTER)
        pictures = [picture(11, 64, 40), picture(12, 20, 30)]
        prompt = llm.tokenizer.encode_with_images(text, [image for image, _ in pictures],
                                                  [ImageInput.digest_of(data) for _, data in pictures])
        inputs = hf_inputs(processor, text, pictures)
        assert prompt.token_ids == inputs["input_ids"][0].tolist()
        torch.testing.assert_close(torch.cat([image.pixels["pixel_values"] for image in prompt.images]),
                                   inputs["pixel_values"], atol=0, rtol=0)
        assert_prompt_logprobs_match_hf(llm, prompt, model, inputs)
    finally:
        llm.engine.close()
