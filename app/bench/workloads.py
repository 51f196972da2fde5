"""The prompt sets the benches run: filler text cut to a length, varied chat requests, multi-turn chat
messages, the speculative-decoding prompts (spec_prompts.json), the held-out perplexity text and random
token ids."""

from __future__ import annotations

import json
import random
from importlib.resources import files

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the budget, "
          "the schedule and the staffing plan for the coming year. ")


def prompt_ids(tokenizer, n: int) -> list[int]:
    """`n` token ids of filler text."""
    ids = tokenizer.encode(FILLER * (n // 10 + 1))
    return ids[:n]


QUESTIONS = [
    "What is the capital of Australia?",
    "Explain in simple terms why the sky is blue.",
    "Write a haiku about autumn leaves.",
    "How many legs does a spider have?",
    "Give me three tips for sleeping better.",
    "What is the difference between a list and a tuple in Python?",
    "Translate 'good morning, how are you?' into French.",
    "Suggest a name for a small bakery that sells sourdough bread.",
    "Why do cats purr?",
    "What is 17 multiplied by 23? Show your working.",
    "Write a short, polite email asking my manager for a day off next Friday.",
    "List the planets of the solar system in order from the sun.",
    "What does HTTP stand for, and what is it used for?",
    "Describe the water cycle in a few sentences.",
    "Who wrote the play Romeo and Juliet?",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What are the main causes of inflation?",
    "Explain what a hash table is to a beginner programmer.",
    "Write a limerick about a programmer who loves coffee.",
    "What is photosynthesis?",
    "How do I reverse a string in JavaScript?",
    "What are some good exercises for lower back pain?",
    "Summarize the plot of Cinderella in three sentences.",
    "Why is it important to drink water during exercise?",
    "What is the boiling point of water at the top of a high mountain, and why is it different?",
    "Write a motivational sentence for someone starting a new job.",
    "Explain the rules of chess for the knight piece.",
    "What is the tallest mountain in Europe?",
    "Compare electric cars and petrol cars in terms of running costs.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that counts the orders per customer in a table called orders.",
    "What should I pack for a weekend hiking trip?",
]

PASSAGES = [
    "The town council met on Tuesday evening to discuss the new cycling lanes planned for the high street. "
    "Shop owners worried that removing parking spaces would keep customers away, while parents argued that "
    "safer routes would let more children cycle to school. The council agreed to run a six-month trial.",

    "Honeybees communicate the location of food through a behaviour called the waggle dance. A forager that "
    "has found a rich patch of flowers returns to the hive and runs in a figure-of-eight pattern on the "
    "vertical surface of the comb. The angle of the straight 'waggle' run relative to vertical tells the "
    "other bees the direction of the food relative to the sun, and the duration of the run encodes the "
    "distance. Bees that follow the dancer pick up the scent of the flowers from her body as well, which "
    "helps them recognise the right patch once they arrive. Researchers have decoded these dances to map "
    "where colonies forage across a whole landscape.",

    "Our quarterly results show revenue of 4.2 million euros, up 12 percent on the same quarter last year, "
    "driven mainly by the subscription business, which grew 31 percent. Hardware sales fell 8 percent as "
    "customers delayed upgrades ahead of the new product line. Operating costs rose 9 percent, largely "
    "because we hired fourteen engineers for the platform team and opened the Lisbon office. Cash on hand at "
    "the end of the quarter was 11.5 million euros. For the next quarter we expect subscription growth to "
    "slow slightly, hardware to recover once the new line ships in May, and costs to stay flat. The board "
    "has approved a budget for two more sales hires in the Nordic region, and we will review pricing for the "
    "entry-level plan before the summer.",

    "def merge_intervals(intervals):\n"
    "    intervals.sort(key=lambda pair: pair[0])\n"
    "    merged = []\n"
    "    for start, end in intervals:\n"
    "        if merged and start <= merged[-1][1]:\n"
    "            merged[-1][1] = max(merged[-1][1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n",

    "The Industrial Revolution began in Britain in the late eighteenth century and spread to continental "
    "Europe and North America over the following decades. Several factors came together to make Britain the "
    "starting point: abundant deposits of coal and iron ore, a growing population that supplied both workers "
    "and customers, a stable political system that protected property and encouraged investment, and an "
    "overseas empire that provided raw materials such as cotton as well as markets for finished goods. The "
    "textile industry was the first to be transformed. Inventions such as the spinning jenny, the water frame "
    "and the power loom moved production out of homes and small workshops into large mills, first powered by "
    "water wheels and later by steam engines. James Watt's improvements to the steam engine made it far more "
    "efficient and allowed factories to be built away from rivers, close to coalfields and cities. Railways "
    "followed in the 1820s and 1830s, cutting the cost and time of moving goods and people and creating a "
    "national market. The social consequences were profound. Cities such as Manchester and Birmingham grew "
    "at a pace that housing and sanitation could not match, working hours in the mills were long, and child "
    "labour was common until a series of Factory Acts began to limit it. Over the longer term, however, "
    "productivity gains raised living standards, and the period laid the foundations of the modern economy.",

    "Dear support team, I bought the X200 wireless headphones from your online shop three weeks ago. Since "
    "last weekend the left ear cup cuts out every few minutes, even when the phone is right next to me and "
    "the battery is full. I have already tried resetting them and re-pairing them with two different phones. "
    "Could you tell me whether this is covered by the warranty and how to send them back?",
]

PASSAGE_TASKS = [
    "Summarize the following text in two sentences:\n\n{text}",
    "{text}\n\nWhat is the main point of the text above?",
    "Read this and list the three most important facts as bullet points:\n\n{text}",
    "{text}\n\nWrite a short, friendly reply or comment to the text above.",
    "Explain the following to a ten-year-old:\n\n{text}",
    "{text}\n\nSuggest a title for this text.",
]


def chat_messages(num_requests: int) -> list[list[dict]]:
    """Deterministic, varied chat requests: short questions and tasks on a pasted passage, shuffled
    with a fixed seed (the first few are then a fair sample of the lengths); cycles beyond the pool."""
    pool = list(QUESTIONS) + [task.format(text=p) for p in PASSAGES for task in PASSAGE_TASKS]
    random.Random(0).shuffle(pool)
    return [[{"role": "user", "content": pool[i % len(pool)]}] for i in range(num_requests)]


CHAT_TASKS = [
    "Please read this carefully and tell me what you think the key point is.",
    "Can you summarize the following in plain words?",
    "I found this text. What questions would you ask the author?",
    "Explain the following to a friend who has never heard of it.",
    "What is surprising or unusual in the text below?",
    "Give me one sentence that captures this, then one that criticises it.",
    "Rewrite the main idea below as advice for a beginner.",
    "What would be a good title for this, and why?",
]


def user_messages(tokenizer, turns: int, user_tokens: int) -> list[str]:
    """Deterministic, varied user messages of about `user_tokens` tokens each: a task and a question from
    the built-in pools, then sentences of the built-in passages from a different place each turn."""
    sentences = [s.strip() + "." for p in PASSAGES if "def " not in p for s in p.split(". ") if s.strip()]
    messages = []
    for t in range(turns):
        start = (t * 7) % len(sentences)
        body = " ".join((sentences[start:] + sentences[:start]) * 4)
        text = f"{CHAT_TASKS[t % len(CHAT_TASKS)]} Also: {QUESTIONS[(t * 5) % len(QUESTIONS)]}\n\n{body}"
        messages.append(tokenizer.decode(tokenizer.encode(text)[:user_tokens]).strip())
    return messages


def spec_prompts() -> dict[str, list[dict]]:
    """The speculative-decoding bench's prompts per task: {"grounded": [{"name", "prompt"}, ...], "chat": ...}."""
    return json.loads(files("kvforge.app.bench").joinpath("spec_prompts.json").read_text())


def eval_text() -> str:
    """The held-out text perplexity is measured on."""
    return files("kvforge.app.bench").joinpath("eval_text.txt").read_text()


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids that every random model's vocabulary holds (no special
    ids), the same for a seed."""
    import torch

    from kvforge.app.bench.random_models import FIRST_PROMPT_ID, PROMPT_VOCAB

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_PROMPT_ID, PROMPT_VOCAB, (count, length), generator=gen).tolist()
