"""Notebook 12's checks (pagedlab/course/prefix.py): the course's solutions pass and are returned;
stubs say "not written yet"; planted bugs in the hash chain and in the ref-counted allocator each
fail with a message that shows what went wrong and gives the matching hint."""
import hashlib
from array import array

import pytest

from pagedlab.course import prefix as course_prefix
from pagedlab.course import CheckFailed

sol_keys = course_prefix.solution("block_keys")
Sol = course_prefix.solution("PrefixAllocator")


@pytest.fixture(autouse=True)
def _no_solutions(monkeypatch):
    monkeypatch.delenv("PAGEDLAB_SOLUTIONS", raising=False)


def test_solutions_pass_and_are_returned(capsys):
    assert course_prefix.check_block_keys(sol_keys) is sol_keys
    assert course_prefix.check_prefix_allocator(Sol) is Sol
    out = capsys.readouterr().out
    assert "\u2713 block_keys" in out and "\u2713 PrefixAllocator" in out


def test_solutions_switch(monkeypatch):
    monkeypatch.setenv("PAGEDLAB_SOLUTIONS", "1")
    assert course_prefix.check_block_keys(lambda t, b: []).__name__ == "block_keys"
    assert course_prefix.check_prefix_allocator(object).__name__ == "PrefixAllocator"


def test_stubs_say_not_written():
    def stub(token_ids, block_size):
        raise NotImplementedError("hash each full block with its parent's key")

    class Stub(Sol):
        def lookup(self, keys):
            raise NotImplementedError("lookup")
    for check, fn, name in ((course_prefix.check_block_keys, stub, "block_keys"),
                            (course_prefix.check_prefix_allocator, Stub, "PrefixAllocator")):
        with pytest.raises(CheckFailed, match="not written yet") as e:
            check(fn)
        assert f"show_solution({name!r})" in str(e.value)


def _h(parent, tokens):
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def no_chain(token_ids, bs):             # each block hashed alone: a repeated block gets the same key
    return [_h(b"pagedlab-prefix-v1", token_ids[j * bs:(j + 1) * bs]) for j in range(len(token_ids) // bs)]


def with_partial(token_ids, bs):         # a key for the partial last block too
    keys = sol_keys(token_ids, bs)
    if len(token_ids) % bs:
        keys.append(_h(keys[-1] if keys else b"pagedlab-prefix-v1", token_ids[len(keys) * bs:]))
    return keys


def wrong_root(token_ids, bs):
    keys = []
    for j in range(len(token_ids) // bs):
        keys.append(_h(keys[-1] if keys else b"", token_ids[j * bs:(j + 1) * bs]))
    return keys


@pytest.mark.parametrize("fn,says", [(no_chain, "parent is key j-1"), (with_partial, "FULL blocks"),
                                     (wrong_root, "parent is ROOT"),
                                     (lambda t, bs: [k.hex() for k in sol_keys(t, bs)], "list of bytes")])
def test_key_bugs(fn, says):
    with pytest.raises(CheckFailed, match=says):
        course_prefix.check_block_keys(fn)


class NoCaching(Sol):                    # a released block always goes back to the free list
    def free(self, blocks):
        for b in blocks:
            if self.ref_count.get(b, 0) == 0:
                raise RuntimeError("not held")
            self.ref_count[b] -= 1
            if not self.ref_count[b]:
                del self.ref_count[b]
                self.free_blocks.append(b)


class EvictsNewest(Sol):                 # evicts the most recently used cached block
    def allocate(self, n, shared=()):
        if not self.free_blocks and self.cached:
            self.cached.move_to_end(next(reversed(self.cached)), last=False)
        return super().allocate(n, shared)


class KeepsKey(Sol):                     # evicts a block but leaves its key in the map
    def allocate(self, n, shared=()):
        revived = sum(b in self.cached for b in shared)
        if n + revived > len(self.free_blocks) + len(self.cached):
            raise RuntimeError("out of blocks")
        taken = list(shared)
        for b in shared:
            self.cached.pop(b, None)
            self.ref_count[b] = self.ref_count.get(b, 0) + 1
        for _ in range(n):
            b = self.free_blocks.popleft() if self.free_blocks else self.cached.popitem(last=False)[0]
            self.ref_count[b] = 1
            taken.append(b)
        return taken


class LookupSkips(Sol):                  # does not stop at the first miss
    def lookup(self, keys):
        return [self.block_of[k] for k in keys if k in self.block_of]


class HitStaysCached(Sol):               # a cached hit is counted but left in the LRU
    def allocate(self, n, shared=()):
        keep = [b for b in shared if b in self.cached]
        got = super().allocate(n, shared)
        for b in keep:
            self.cached[b] = None
        return got


class NoCheckFirst(Sol):                 # takes blocks before finding out it cannot give them all
    def allocate(self, n, shared=()):
        taken = list(shared)
        for b in shared:
            self.cached.pop(b, None)
            self.ref_count[b] = self.ref_count.get(b, 0) + 1
        for _ in range(n):
            b = self.free_blocks.popleft() if self.free_blocks else self.cached.popitem(last=False)[0]
            self.block_of.pop(self.key_of.pop(b, None), None)
            self.ref_count[b] = 1
            taken.append(b)
        return taken


@pytest.mark.parametrize("cls,says", [(NoCaching, "cached blocks"), (EvictsNewest, "least recently used"),
                                      (KeepsKey, "key -> block map"), (LookupSkips, "first key that is not"),
                                      (HitStaysCached, "OUT of `cached`"), (NoCheckFirst, "changed the allocator")])
def test_allocator_bugs(cls, says):
    with pytest.raises(CheckFailed, match=says) as e:
        course_prefix.check_prefix_allocator(cls)
    assert "after\n" in str(e.value)           # the operations that led there
