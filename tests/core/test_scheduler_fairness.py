"""The scheduler's fair sharing between client requests (core/scheduler.py), on the real Scheduler and KV manager
without a model: steps are planned and their sampled tokens made up. A heavy request (many embedding inputs, n
samples, a long prefill) beside a small chat: the chat is admitted within a step or two and gets its token every
step; the heavy one still gets the whole budget when alone; one sequence per request stays first come first
served."""

from __future__ import annotations

from kvforge.core.kv.blocks import BlockPool
from kvforge.core.kv.manager import KVCacheManager
from kvforge.core.pooling import PoolingParams
from kvforge.core.request import Sequence, Status
from kvforge.core.sampler import StepTokens
from kvforge.core.sampling import SamplingParams
from kvforge.core.scheduler import Scheduler
from kvforge.core.step import StepPlan

BLOCK = 16


def scheduler(num_blocks: int = 4096, max_num_seqs: int = 8, budget: int = 256) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), BLOCK, b"root")
    return Scheduler(kv, max_model_len=4096, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


class Requests:
    """Adds requests with increasing arrival numbers, as the engine does."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.arrival = sched, 0

    def chat(self, name: str, prompt_len: int = 8, max_tokens: int = 4, n: int = 1) -> list[Sequence]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
        start = 10_000 * (self.arrival + 1)  # a prompt of its own: no prefix-cache hits between requests
        samples = [Sequence(name, list(range(start, start + prompt_len)), params, index=i, arrival=self.arrival)
                   for i in range(n)]
        self.arrival += 1
        self.sched.add(samples[0], forks=samples[1:])
        return samples

    def embeddings(self, group: str, count: int, prompt_len: int) -> list[Sequence]:
        seqs = []
        for i in range(count):
            seq = Sequence(f"{group}-{i}", [5 + i] * prompt_len, PoolingParams(), arrival=self.arrival, group=group)
            self.arrival += 1
            self.sched.add(seq)
            seqs.append(seq)
        return seqs


def step(sched: Scheduler) -> StepPlan:
    """Plan a step and apply it, every sampled row getting token 7."""
    plan = sched.schedule()
    rows = plan.sampling_rows
    sampled = StepTokens([[7] for _ in rows], [None] * len(rows), [None] * len(rows)) if rows else None
    sched.update_from_output(plan, sampled)
    return plan


def tokens_of(plan: StepPlan, group: str) -> int:
    return sum(item.num_new_tokens for item in plan.scheduled if item.seq.share_group == group)


def test_a_chat_beside_an_embedding_batch_is_admitted_at_once_and_decodes_every_step():
    sched = scheduler()
    add = Requests(sched)
    batch = add.embeddings("batch", 40, prompt_len=200)
    assert tokens_of(step(sched), "batch") == 256  # alone: the whole budget
    chat = add.chat("chat", max_tokens=5)[0]
    steps = 0
    while not chat.is_finished:
        plan = step(sched)
        steps += 1
        if steps > 1:  # its prompt, then one token each step
            assert tokens_of(plan, "chat") == 1 and tokens_of(plan, "batch") == 255
    assert steps == 5  # its prompt and first token at once, then 4 more tokens
    assert sum(s.is_finished for s in batch) < 10  # the batch was not run first


def test_first_come_first_served_would_have_made_the_chat_wait_for_the_whole_batch():
    """The same load with every sequence its own group, as before fair sharing: the chat's first token comes only
    after the batch's sequences ahead of it (this is what the test above guards against)."""
    sched = scheduler()
    add = Requests(sched)
    for i in range(40):
        add.sched.add(Sequence(f"e{i}", [5 + i] * 200, PoolingParams(), arrival=i))
    add.arrival = 40
    step(sched)
    chat = add.chat("chat", max_tokens=5)[0]
    steps = 0
    while chat.first_token_time is None:
        step(sched)
        steps += 1
    assert steps > 20


def test_a_lone_heavy_request_gets_the_whole_budget_in_arrival_order():
    sched = scheduler(budget=256)
    add = Requests(sched)
    batch = add.embeddings("batch", 20, prompt_len=100)
    plan = step(sched)
    assert [(item.seq, item.num_new_tokens) for item in plan.scheduled] == [(batch[0], 100), (batch[1], 100),
                                                                          (batch[2], 56)]


def test_the_budget_is_split_max_min_fairly_between_prefilling_requests_and_the_waiting_line():
    sched = scheduler(budget=300)
    add = Requests(sched)
    add.chat("a", prompt_len=1000)
    assert tokens_of(step(sched), "a") == 300  # alone
    add.chat("b", prompt_len=1000)
    plan = step(sched)  # a and the line (b) half each
    assert [(item.seq.request_id, item.num_new_tokens) for item in plan.scheduled] == [("a", 150), ("b", 150)]
    add.chat("c", prompt_len=40)
    plan = step(sched)  # c's 40 are less than a third: a and b share what it leaves
    assert {item.seq.request_id: item.num_new_tokens for item in plan.scheduled} == {"a": 130, "b": 130, "c": 40}


def test_requests_arriving_together_are_prefilled_in_turn_and_reuse_the_first_ones_prefix():
    sched = scheduler(budget=160)
    shared = list(range(100, 164))  # a 64-token system prompt: four full blocks
    chats = []
    for i in range(4):
        chat = Sequence(f"r{i}", shared + [200 + i] * 40, SamplingParams(max_tokens=4), arrival=i)
        sched.add(chat)
        chats.append(chat)
    plan = step(sched)
    assert [(item.seq.request_id, item.num_new_tokens) for item in plan.scheduled] == [("r0", 104), ("r1", 56)]
    step(sched)
    assert chats[2].num_cached_tokens == chats[3].num_cached_tokens == 64  # the prefix r0 computed


def test_n_samples_that_hold_every_slot_give_one_up_to_a_newcomer():
    sched = scheduler(max_num_seqs=8)
    add = Requests(sched)
    samples = add.chat("many", prompt_len=20, max_tokens=1000, n=8)
    step(sched)  # the prompt; the other 7 samples fork off at its end
    assert len(sched.running) == 8
    chat = add.chat("chat", max_tokens=3)[0]
    step(sched)
    assert chat.status is Status.RUNNING and len(sched.running) == 8
    preempted = [s for s in samples if s.status is Status.WAITING]
    assert len(preempted) == 1 and preempted[0].index == 7  # the latest of the group holding the most
    while not chat.is_finished:
        step(sched)
    step(sched)
    assert preempted[0].status is Status.RUNNING  # back in the freed slot, recomputed
    assert sched.num_preemptions == 1


def test_one_sequence_per_request_is_first_come_first_served_without_preemption_for_slots():
    sched = scheduler(max_num_seqs=2)
    add = Requests(sched)
    first, second, third = (add.chat(name, max_tokens=50)[0] for name in ("first", "second", "third"))
    for _ in range(3):
        step(sched)
    assert first.status is second.status is Status.RUNNING and third.status is Status.WAITING
    assert sched.num_preemptions == 0


def test_waiting_groups_are_admitted_round_robin():
    sched = scheduler(max_num_seqs=6, budget=8192)
    add = Requests(sched)
    add.embeddings("a", 10, prompt_len=2000)
    add.embeddings("b", 10, prompt_len=2000)
    add.chat("c", prompt_len=2000)
    plan = step(sched)
    # a, b and c take turns, not a's ten inputs first
    assert [(item.seq.share_group, item.num_new_tokens) for item in plan.scheduled] == [
        ("a", 2000), ("b", 2000), ("c", 2000), ("a", 2000), ("b", 192)]


def test_when_kv_runs_out_the_heavy_group_is_preempted_not_the_chat():
    sched = scheduler(num_blocks=24, max_num_seqs=8, budget=512)
    add = Requests(sched)
    many = add.chat("many", prompt_len=30, max_tokens=300, n=4)
    chat = add.chat("chat", prompt_len=30, max_tokens=300)[0]
    preempted = set()
    for _ in range(60):
        plan = step(sched)
        preempted |= {(s.request_id, s.index) for s in plan.preempted}
    assert preempted and all(request_id == "many" for request_id, _ in preempted)
    assert chat.status is Status.RUNNING and chat.num_preemptions == 0
    assert any(s.num_preemptions for s in many)
