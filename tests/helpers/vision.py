"""Pictures and prompts for the vision-language tests: each tiny family the tests build, a user turn in its words,
its processor's prompt through our code and HF's inputs and greedy tokens (the reference)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from kvforge.core.images import ImageInput, ImagePrompt
from kvforge.core.models.registry import vision_family
from tests.helpers.tiny_models import save_tiny_gemma3_vision, save_tiny_idefics3

NEW_TOKENS = 12
TEXT_AFTER = " Describe what you see in the picture above, in detail, with colours and shapes and every small thing."


def picture(seed: int, height: int, width: int) -> tuple[Image.Image, bytes]:
    """A random RGB picture and its bytes (what a client would send)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels), pixels.tobytes()


# each family: its builder, how a user turn starts, the prefill budget and the KV blocks of the chunked test (Gemma 3's
# budget is smaller than its 16-token image: that chunk must take the whole image anyway; its prompts are shorter)
FAMILIES = {"idefics3": (save_tiny_idefics3, "User:", 16, 12),
            "gemma3": (save_tiny_gemma3_vision, "<start_of_turn>user\n", 8, 7)}
ARCHITECTURES = {"idefics3": "Idefics3ForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}


def family_of(processor) -> str:
    return "gemma3" if "Gemma3" in type(processor).__name__ else "idefics3"


def user(processor, text: str) -> str:
    """A user turn of `text` in the family's words, "<image>" standing for each picture's placeholder."""
    return FAMILIES[family_of(processor)][1] + text.replace("<image>", processor.image_token)


def prompt_of(processor, text: str, pictures: list[tuple[Image.Image, bytes]]) -> ImagePrompt:
    family = vision_family([ARCHITECTURES[family_of(processor)]])
    return family.image_prompt(processor, text, [image for image, _ in pictures],
                               [ImageInput.digest_of(data) for _, data in pictures])


def hf_inputs(processor, text: str, pictures) -> dict:
    return processor(text=[text], images=[[image for image, _ in pictures]] if pictures else None,
                     return_tensors="pt", add_special_tokens=False)


def hf_generate(model, inputs: dict, new_tokens: int = NEW_TOKENS) -> list[int]:
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()




def assert_prompt_logprobs_match_hf(llm, prompt: ImagePrompt, model, inputs: dict) -> None:
    """Every prompt position's log-probability (image positions included) from `llm` within 1e-4 of the HF model's
    on the processor's `inputs` for the same prompt."""
    from kvforge.core import SamplingParams

    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    ours = torch.tensor([entry.logprob for entry in out.prompt_logprobs])
    with torch.inference_mode():
        logits = model(**inputs).logits[0, :-1].float()
    theirs = torch.log_softmax(logits, -1).gather(1, inputs["input_ids"][0, 1:].view(-1, 1)).view(-1)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
