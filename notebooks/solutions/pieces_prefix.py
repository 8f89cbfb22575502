"""Solutions to notebook 12's pieces (checked by prefix_course.check_block_keys and
prefix_course.check_prefix_allocator). Read one with prefix_course.show_solution("block_keys") or
("PrefixAllocator"); PAGEDLAB_SOLUTIONS=1 makes the checks use these."""
import hashlib
from array import array
from collections import OrderedDict, deque

ROOT = b"pagedlab-prefix-v1"      # the parent of a sequence's first block


def block_keys(token_ids, block_size):
    keys = []
    for j in range(len(token_ids) // block_size):                  # full blocks only
        parent = keys[-1] if keys else ROOT
        h = hashlib.blake2b(parent, digest_size=16)                # the chain: the parent's key ...
        h.update(array("q", token_ids[j * block_size:(j + 1) * block_size]).tobytes())   # ... + its tokens
        keys.append(h.digest())
    return keys


class PrefixAllocator:
    def __init__(self, num_blocks):
        self.free_blocks = deque(range(num_blocks))   # never filled, or nothing worth keeping
        self.cached = OrderedDict()                   # nobody holds them, their key is known; LRU first
        self.ref_count = {}                           # held block -> how many requests hold it
        self.block_of = {}                            # key -> block
        self.key_of = {}                              # block -> key

    def register(self, block, key):
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key], self.key_of[block] = block, key
        return True

    def lookup(self, keys):
        hits = []
        for key in keys:
            if key not in self.block_of:
                break                                 # the first miss ends the shared prefix
            hits.append(self.block_of[key])
        return hits

    def allocate(self, n, shared=()):
        revived = sum(b in self.cached for b in shared)
        if n + revived > len(self.free_blocks) + len(self.cached):
            raise RuntimeError(f"out of blocks: {n} fresh + {revived} cached hits asked for")
        taken = list(shared)
        for b in shared:
            self.cached.pop(b, None)                  # a cached hit is held again: out of the LRU
            self.ref_count[b] = self.ref_count.get(b, 0) + 1
        for _ in range(n):
            if self.free_blocks:
                b = self.free_blocks.popleft()
            else:                                     # evict the least recently used cached block
                b, _ = self.cached.popitem(last=False)
                del self.block_of[self.key_of.pop(b)]
            self.ref_count[b] = 1
            taken.append(b)
        return taken

    def free(self, blocks):
        for b in blocks:
            if self.ref_count.get(b, 0) == 0:
                raise RuntimeError(f"block {b} is not held")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                del self.ref_count[b]
                if b in self.key_of:
                    self.cached[b] = None             # keep its K/V: most recently used
                else:
                    self.free_blocks.append(b)
