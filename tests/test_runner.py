"""The runner's host-side addressing: where each new token's K/V goes (its KV slot)."""
import random
from types import SimpleNamespace

from pagedlab.runner import decode_kv_slots, kv_slots


def test_kv_slots_follow_the_block_table_rule():
    rnd = random.Random(0)
    for _ in range(300):
        bs = rnd.choice([1, 3, 4, 16])
        n = rnd.randint(1, 90)
        blocks = rnd.sample(range(1000), -(-n // bs))
        start = rnd.randint(0, n - 1)
        end = rnd.randint(start + 1, n)
        want = [blocks[p // bs] * bs + p % bs for p in range(start, end)]   # token p, one by one
        assert kv_slots(blocks, start, end, bs) == want


def test_decode_slots_are_kv_slots_of_the_last_token():
    rnd = random.Random(1)
    for bs in (1, 5, 16):
        reqs = []
        for _ in range(40):
            n = rnd.randint(1, 70)
            reqs.append(SimpleNamespace(num_tokens=n, blocks=rnd.sample(range(500), -(-n // bs))))
        assert decode_kv_slots(reqs, bs) == [kv_slots(r.blocks, r.num_tokens - 1, r.num_tokens, bs)[0]
                                             for r in reqs]
