"""Random allocate / free / evict / remap / translate / retract / resume sequences against a
plain-Python model of the two-sided allocator: never a stale translation, never a leaked or
double-freed page, the mapping tensor always equal to the model's (same storage, trailing -1),
and a retracted request's KV bytes back byte for byte after its resume. The SWA location cache
verifies every hit (swa_cache_verify=True), so any stale hit raises inside the step that made
it."""

import copy

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from mem_pool_testlib import small_pool

P = 4
FULL_PAGES, SWA_PAGES = 10, 6
RATIOS = (0, 4, 0)                  # SWA layers, and one C4 layer with its indexer
LAYERS = len(RATIOS)


def ceil_div(a, b):
    return -(-a // b)


class Model:
    """Free pages of both sides, the full->SWA page map, and each request's locations."""

    def __init__(self):
        self.full_free = set(range(1, FULL_PAGES + 1))
        self.swa_free = set(range(1, SWA_PAGES + 1))
        self.swa_of: dict[int, int] = {}
        self.reqs: dict[int, torch.Tensor] = {}

    def take(self, al, full_pages):
        """Record pages the allocator just handed out (the allocator picks which)."""
        for fp in full_pages:
            sp = int(al.full_to_swa_index_mapping[fp * P]) // P
            assert fp in self.full_free and sp in self.swa_free
            self.full_free.remove(fp)
            self.swa_free.remove(sp)
            self.swa_of[fp] = sp

    def drop_swa(self, full_pages):
        for fp in full_pages:
            if fp in self.swa_of:
                self.swa_free.add(self.swa_of.pop(fp))

    def expected_mapping(self):
        m = torch.zeros((FULL_PAGES + 1) * P + 1, dtype=torch.int64)
        m[-1] = -1
        for fp, sp in self.swa_of.items():
            m[fp * P:(fp + 1) * P] = sp * P + torch.arange(P)
        return m

    def can_take(self, n_pages):
        return n_pages <= len(self.full_free) and n_pages <= len(self.swa_free)


def pages_of(locs):
    return sorted(set((locs // P).tolist()))


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool, self.al = small_pool(RATIOS, full_tokens=FULL_PAGES * P,
                                        swa_tokens=SWA_PAGES * P, page_size=P,
                                        swa_cache_verify=True)
        g = torch.Generator().manual_seed(0)
        for table in (self.pool.swa_caches, self.pool.c4_caches, self.pool.indexer_caches):
            for cache in table.values():            # distinct bytes, so a misplaced row shows
                cache.copy_(torch.randint(0, 256, cache.shape, generator=g, dtype=torch.uint8))
        self.retracted: list[tuple[torch.Tensor, object]] = []
        self.mapping = self.al.full_to_swa_index_mapping
        self.ptr = self.mapping.data_ptr()
        self.model = Model()
        self.next_id = 0
        self.freed: list[torch.Tensor] = []
        self.backup = None
        self.static = torch.zeros(8, dtype=torch.int64)    # a graph-style input buffer

    def pick(self, i):
        return sorted(self.model.reqs)[i % len(self.model.reqs)]

    def add_request(self, locs):
        self.model.reqs[self.next_id] = locs
        self.next_id += 1

    # ---- allocation ---------------------------------------------------------------------

    @rule(n=st.integers(1, 3 * P + 2))
    def new_request(self, n):
        ok = self.model.can_take(ceil_div(n, P))
        locs = self.al.alloc_extend([0], [n], [-1], n)
        assert (locs is not None) == ok
        if ok:
            assert (locs % P == torch.arange(n) % P).all()
            self.model.take(self.al, pages_of(locs))
            self.add_request(locs)

    @rule(k=st.integers(1, 3))
    def alloc_pages(self, k):
        locs = self.al.alloc(k * P)
        assert (locs is not None) == self.model.can_take(k)
        if locs is not None:
            self.model.take(self.al, pages_of(locs))
            self.add_request(locs)

    def _continues_evicted_page(self, locs):
        return locs.numel() % P != 0 and int(locs[-1]) // P not in self.model.swa_of

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99), k=st.integers(1, 2 * P))
    def extend(self, i, k):
        rid = self.pick(i)
        locs = self.model.reqs[rid]
        n = locs.numel()
        args = ([n], [n + k], [int(locs[-1])], k)
        if self._continues_evicted_page(locs):
            with pytest.raises(ValueError, match="SWA page was freed"):
                self.al.alloc_extend(*args)
            return
        new = self.al.alloc_extend(*args)
        assert (new is not None) == self.model.can_take(ceil_div(n + k, P) - ceil_div(n, P))
        if new is not None:
            self.model.take(self.al, sorted(set(pages_of(new)) - set(pages_of(locs))))
            self.model.reqs[rid] = torch.cat([locs, new])

    @precondition(lambda self: self.model.reqs)
    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3, unique=True))
    def decode(self, picks):
        rids = sorted({self.pick(i) for i in picks})
        reqs = [self.model.reqs[r] for r in rids]
        seq_lens = [r.numel() + 1 for r in reqs]
        last = [int(r[-1]) for r in reqs]
        if any(self._continues_evicted_page(r) for r in reqs):
            with pytest.raises(ValueError, match="SWA page was freed"):
                self.al.alloc_decode(seq_lens, last)
            return
        out = self.al.alloc_decode(seq_lens, last)
        assert (out is not None) == self.model.can_take(sum(r.numel() % P == 0 for r in reqs))
        if out is not None:
            for rid, r, loc in zip(rids, reqs, out.tolist()):
                if r.numel() % P == 0:
                    self.model.take(self.al, [loc // P])
                self.model.reqs[rid] = torch.cat([r, torch.tensor([loc])])
            self.check_translation(out)

    # ---- freeing ------------------------------------------------------------------------

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99))
    def free_request(self, i):
        locs = self.model.reqs.pop(self.pick(i))
        self.al.free(locs)
        self.model.drop_swa(pages_of(locs))
        self.model.full_free.update(pages_of(locs))
        self.freed.append(locs)

    @precondition(lambda self: self.freed)
    @rule(i=st.integers(0, 99))
    def double_free(self, i):
        locs = self.freed[i % len(self.freed)]
        if set(pages_of(locs)) & self.model.full_free:
            with pytest.raises(ValueError, match="not allocated"):
                self.al.free(locs)

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99), window=st.integers(1, 12))
    def free_swa_out_of_window(self, i, window):
        locs = self.model.reqs[self.pick(i)]
        n = max(0, locs.numel() - window) // P
        gone = [fp for fp in pages_of(locs[:n * P]) if fp in self.model.swa_of]
        assert self.al.free_swa_out_of_window(locs, locs.numel(), window) == len(gone)
        self.model.drop_swa(gone)

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def free_swa(self, i, j):
        pages = pages_of(self.model.reqs[self.pick(i)])
        page = pages[j % len(pages)]
        self.al.free_swa(torch.arange(page * P, page * P + P))
        self.model.drop_swa([page])

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99), j=st.integers(0, 99))
    def load_back(self, i, j):
        """Host-cache load-back: a fresh SWA page mapped with set_full_to_swa_mapping."""
        pages = [p for p in pages_of(self.model.reqs[self.pick(i)]) if p not in self.model.swa_of]
        if not pages or not self.model.swa_free:
            return
        page = pages[j % len(pages)]
        swa = self.al.swa_attn_allocator.alloc(P)
        sp = int(swa[0]) // P
        self.model.swa_free.remove(sp)
        self.al.set_full_to_swa_mapping(torch.arange(page * P, page * P + P), swa)
        self.model.swa_of[page] = sp

    # ---- retraction ---------------------------------------------------------------------

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99))
    def retract(self, i):
        """Copy a request's rows to the host and free its pages (dsv4.retraction.retract)."""
        rid = self.pick(i)
        locs = self.model.reqs.pop(rid)
        host = self.pool.get_cpu_copy(locs)
        self.al.free(locs)
        self.model.drop_swa(pages_of(locs))
        self.model.full_free.update(pages_of(locs))
        self.retracted.append((locs, host))

    @precondition(lambda self: self.retracted)
    @rule(i=st.integers(0, 99))
    def resume(self, i):
        self.resume_at(i % len(self.retracted))

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99))
    def retract_and_resume(self, i):
        """Both in one step (resuming is rare otherwise): the pages freed go to the back of
        the free list, so the request comes back on other pages."""
        self.retract(i)
        self.resume_at(len(self.retracted) - 1)

    def resume_at(self, k):
        """Fresh pages for the same length, SWA pages dropped where the copy has none (the
        engine's out-of-window free), the copy loaded back: the bytes read back equal it."""
        n, host = self.retracted[k][0].numel(), self.retracted[k][1]
        if not self.model.can_take(ceil_div(n, P)):
            assert self.al.alloc_extend([0], [n], [-1], n) is None
            event("resume: no room")
            return
        event("resume: loaded back")
        del self.retracted[k]
        locs = self.al.alloc_extend([0], [n], [-1], n)
        self.model.take(self.al, pages_of(locs))
        self.add_request(locs)
        swa_mask = host.families["swa"].mask
        dropped = pages_of(locs[~swa_mask])
        if dropped:
            event("resume: with SWA pages dropped")
            self.al.free_swa(self.al.full_attn_allocator.page_locations(torch.tensor(dropped)))
            self.model.drop_swa(dropped)
        self.pool.load_cpu_copy(host, locs)
        back = self.pool.get_cpu_copy(locs)
        for family, rows in host.families.items():
            assert torch.equal(back.families[family].mask, rows.mask)
            for layer, (values, scales) in rows.layers.items():
                got_values, got_scales = back.families[family].layers[layer]
                assert torch.equal(got_values, values) and torch.equal(got_scales, scales)

    # ---- whole state --------------------------------------------------------------------

    @rule()
    def backup_state(self):
        self.backup = (self.al.backup_state(), copy.deepcopy(self.model))

    @precondition(lambda self: self.backup is not None)
    @rule()
    def restore_state(self):
        state, model = self.backup
        self.al.restore_state(state)
        self.model = copy.deepcopy(model)
        self.freed.clear()
        self.retracted.clear()                 # their pages may be someone's again

    @precondition(lambda self: len(self.model.reqs) >= 3)
    @rule()
    def clear(self):
        self.al.clear()
        self.model = Model()
        self.freed.clear()
        self.retracted.clear()

    # ---- translation --------------------------------------------------------------------

    def check_translation(self, loc, layer_id=None):
        want = torch.tensor([self.model.swa_of.get(x // P, 0) * P + x % P
                             if x // P in self.model.swa_of else 0 for x in loc.tolist()],
                            dtype=torch.int32)
        for _ in range(2):
            got = self.pool.get_cached_swa_loc(loc, layer_id)
            assert got.dtype == torch.int32 and torch.equal(got, want)

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99), layer=st.integers(0, LAYERS - 1), start=st.integers(0, 8))
    def translate(self, i, layer, start):
        locs = self.model.reqs[self.pick(i)]
        hits = self.pool.swa_loc_stats.hits
        self.check_translation(locs, layer)
        self.check_translation(locs[start:], layer)             # a view at another offset
        assert self.pool.swa_loc_stats.hits >= hits + 2
        assert torch.equal(self.pool.translate_loc_from_full_to_swa(locs),
                           self.pool.get_cached_swa_loc(locs))

    @precondition(lambda self: self.model.reqs)
    @rule(i=st.integers(0, 99))
    def refill_static_buffer(self, i):
        locs = self.model.reqs[self.pick(i)][:8]
        self.static.zero_()
        self.static[:locs.numel()].copy_(locs)                  # padded rows: location 0
        self.check_translation(self.static)

    # ---- invariants ---------------------------------------------------------------------

    @invariant()
    def mapping_matches_the_model(self):
        assert self.al.full_to_swa_index_mapping is self.mapping
        assert self.pool.full_to_swa_index_mapping is self.mapping
        assert self.mapping.data_ptr() == self.ptr
        assert torch.equal(self.mapping, self.model.expected_mapping())

    @invariant()
    def every_cached_translation_is_fresh(self):
        for locs in self.model.reqs.values():
            assert torch.equal(self.pool.get_cached_swa_loc(locs),
                               self.mapping[locs].to(torch.int32))

    @invariant()
    def no_page_leaked_or_shared(self):
        m = self.model
        held = [p for locs in m.reqs.values() for p in pages_of(locs)]
        assert len(held) == len(set(held))                      # no page in two requests
        assert set(held) | m.full_free == set(range(1, FULL_PAGES + 1))
        assert not set(held) & m.full_free
        assert set(m.swa_of) <= set(held)
        swa_held = list(m.swa_of.values())
        assert len(swa_held) == len(set(swa_held))
        assert set(swa_held) | m.swa_free == set(range(1, SWA_PAGES + 1))
        assert self.al.full_available_size() == len(m.full_free) * P
        assert self.al.swa_available_size() == len(m.swa_free) * P


AllocatorMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50,
                                              deadline=None)
TestAllocatorStateMachine = AllocatorMachine.TestCase
