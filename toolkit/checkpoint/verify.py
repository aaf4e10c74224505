"""Verification of `toolkit convert`'s output, in memory bounded by one decoder layer plus the embeddings, at any
model size. Two checks, both on by default; any difference fails the conversion before anything reaches DST.

Bit-exact read-back: every tensor of the output must hash (xxh3-128) as the source's tensor does after the
requested cast. The weights are hashed on the logit check's own reads (below, `Hashed`): each weight the source
side hands out is hashed, and the output side's tensor of that name must hash the same, so the source and the
output are each read once for both checks. What that check does not read (the optimizer state) is hashed as it is
read for writing (`Digests`) and read back through the output's reader, tensor by tensor, afterwards (`read_back`).

Logits: transformers' own model class for the config is built on the meta device (no memory), and TOKENS fixed tokens
run through it one module at a time: the embeddings, each decoder layer (`model.model.layers[i]`, with RoPE from
`model.model.rotary_emb`), the final norm, the output layer. Each module's weights are read from the source, then
from the output, and each output tensor must equal the source's of its name in bytes, shape and dtype. Then one
side's weights are given to the module just before it runs (loaded with assign=True, strict: every name and shape
transformers expects; the module's hashes finish on their threads meanwhile, and are compared before the next
module is read) and it goes back to the meta device after: the two sides' forwards would agree bit for bit, on
these tokens and on any other, so only one runs (both did until 2026-12-05: half the check's time). It is the side
whose weights cost least to hand out (_Side.cost: a Hugging Face folder's are views of its mapped files, a Megatron
side's are merged from TP shards); the other is only hashed, where its weights lie in pieces without assembling
them (verify_hash.pieces). Without the hashes (verify_logits(hash_weights=False), kept in the API and tested) both
sides run and their hidden states must agree bit for bit after every module.

Independence: a side that stores Hugging Face names (a Hugging Face folder, a DeepSpeed checkpoint) is read by the
names transformers' modules carry. A Megatron side (source or output) is read by merging each parameter's TP
shards with its rule and placing the rule's parts (q, k, v; gate, up) by the family's `modules` table (e.g.
toolkit/families/llama.py MODULES), written apart from the conversion map. So a mistake in the map (q and k
swapped) does not cancel out on the way back: the two sides' tensors of that name then hash differently (the check
names it), and were they not hashed, the two sides' hidden states would disagree. A side's merges are written
into buffers reused module after module (_Buffers): fresh pages cost this VM more than the copies.
"""
from __future__ import annotations

import ctypes
import threading
import time
from pathlib import Path

import torch

from toolkit.checkpoint.safetensors_sources import HFSource
from toolkit.checkpoint.sources import WEIGHT, Source, open_source
from toolkit.checkpoint.verify_hash import HASH_NAME, Digests, Hashed, cast, cast_note, digest, pieces
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries
from toolkit.families.mapping import model_differences
from toolkit.families.registry import family_named
from toolkit.families.rules import merged_into, views
from toolkit.format.names import chunk_key
from toolkit.format.safetensors_stream import mapped
from toolkit.layout import first_stage, last_stage, layer_location

TOKENS = 2
"""Positions the logit check runs: the fewest that exercise causal attention and RoPE across positions (the second
token attends to both, so a q/k swap changes its scores, and the hash-free comparison catches it:
test_convert_verify). This VM's CPU has no bf16 instructions: torch's bf16 matmul for a few rows is a dot product
per token and output (at::native bf16_dot_with_fp32_arith, 42% of a 3B check's CPU time at 4 tokens), so the
forward costs in proportion to the tokens. 2 instead of 4 took a verified 3B HF -> TP2 x PP2 check from 3.1-3.3 to
2.4-2.5 s (5.2-5.5 to 4.0-4.2 CPU-s); with the weights hashed, the logits are the source's on any input anyway."""


def import_early(architecture: str, config: dict) -> None:
    """Import transformers' model class, its auto classes and its config class on a background thread while the
    conversion writes (2-3 s of start-up that then overlaps with I/O instead of adding to the verification; the
    config class alone, imported on first use, took 0.5 s of the check here)."""

    def load() -> None:
        try:
            import transformers  # lazy: heavy; only the logit check needs it
            import transformers.masking_utils  # lazy: as above

            for name in (architecture, "AutoModelForCausalLM"):  # transformers' lazy module imports them on access
                getattr(transformers, name, None)
            transformers.AutoConfig.for_model(config["model_type"], **_fields(config))
        except Exception:  # noqa: BLE001 - the check imports it again and reports any failure there
            pass

    global _early
    if _early is not None and _early.is_alive():  # one import at a time (verify_logits joins it)
        return
    _early = threading.Thread(target=load, daemon=True)
    _early.start()


def join_import() -> None:
    """Wait until import_early's thread (if one was started) has imported transformers."""
    if _early is not None:
        _early.join()


def _fields(config: dict) -> dict:
    """A source's config.json, as keyword arguments of transformers' AutoConfig.for_model."""
    return {k: v for k, v in config.items() if k not in ("torch_dtype", "dtype", "model_type")}


_early: threading.Thread | None = None


def _libc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return lambda _pad: 0


_trim = _libc_trim()


def release() -> None:
    """Hand freed memory back to the kernel. glibc keeps what a loop of same-sized tensors frees in its heaps
    (about 1 MB more per decoder layer was measured here), which would let peak memory creep up with the layer count."""
    _trim(0)


def open_output(source: Source, written: Path) -> Source:
    """A conversion's output, read as its source is: with the model's vocabulary (which a Megatron-LM-style output's
    padded rows do not tell) and the padding rows the conversion carried."""
    return open_source(written, source.config["vocab_size"], checksums=False, rows=source.rows)


def read_back(source: Source, written: Path, fields: tuple[str, ...], digests: Digests, log,
              proved: set[tuple[str, str]] = frozenset(), cast_to: torch.dtype | None = None) -> None:
    """Every tensor of the output that the logit check did not prove (`proved`: the weights, hashed on its reads),
    read through the output's own reader, hashes as the source's did: the optimizer state against the digests
    taken as it was written, a weight left over against the source's tensor (after the conversion's cast), read
    again now."""
    t0 = time.monotonic()
    jobs = [(e.hf_names, f) for e in iter_entries(source.dims(), 1, 1) if e.reads_back for f in fields
            if not all((n, f) in proved for n in e.hf_names)]
    if not jobs:
        log(f"verified: all {len(proved)} tensors read back bit-exactly ({HASH_NAME} against the source's"
            f"{cast_note(source, cast_to, ' cast to ')}, on the logit check's reads of both)")
        return
    # the true vocabulary, for Megatron-LM-style outputs; its manifest was just taken from these files
    again = open_output(source, written)
    try:

        def check(job) -> int:
            names, field = job
            with views(), mapped():  # merged tensors may stay views of the shards: hashed at once, never kept
                if any((n, field) not in digests.of for n in names):  # a weight: hashed from the source now
                    digests.add(names, field, [cast(t, cast_to, field) for t in source.read(list(names), field)])
                tensors = again.read(names, field)
            for name, got in zip(names, tensors):
                if digests.of.get((name, field)) != digest(got):
                    raise ToolkitError(f"verification failed: {name} ({field}) reads back different from what was "
                                       "written from the source; nothing was written")
            del tensors, got
            release()
            return len(names)

        count = sum(map(check, jobs))  # one at a time: two threads were no faster here and held two parameters
    finally:
        again.close()
    log(f"verified: {count + len(proved)} tensors read back bit-exactly ({HASH_NAME} against the source's"
        f"{cast_note(source, cast_to, ' cast to ')}; "
        f"{count} read again in {time.monotonic() - t0:.1f} s, {len(proved)} on the logit check's reads)")


class _Side:
    """One side of the check (the reference or the output): get(names) hands out its weights by Hugging Face name,
    hashed on the way when `hashed` is given; done() once they are no longer referenced."""

    def __init__(self, source: Source, dtype: torch.dtype | None, hashed: Hashed | None, output: bool,
                 buffers: _Buffers):
        self.source, self.dtype, self.hashed, self.output, self.buffers = source, dtype, hashed, output, buffers

    cost = 1
    """What handing out a weight costs, for choosing the side the logit check runs (0: a view of mapped bytes;
    1: some tensors assembled from pieces; 2: every split parameter merged from its TP shards)."""

    def done(self) -> None:
        """What get() handed out is no longer referenced: its buffers serve the next call."""
        if self.hashed is not None:
            self.hashed.settle()  # the hashes read the buffers
        self.buffers.recycle()

    def hash_only(self, names: list[str]) -> None:
        """Hash these weights, as get() does, without handing them out: a tensor stored in pieces is hashed from
        its files' byte ranges (verify_hash.pieces), the rest are read by get() and dropped."""
        left = [n for n in names if not self._hash_pieces(n)]
        if left:
            self.get(left)

    def _hash_pieces(self, name: str) -> bool:
        """Hash this weight where it is stored in pieces (and hashes as stored); False where it is not."""
        stored = self._stored(name)
        if not stored or not self.hashed.takes_ranges(stored[2], self.output):
            return False
        self.hashed.check_ranges(name, *stored, self.output)
        return True

    def _stored(self, name: str):
        """(file byte ranges, shape, dtype) of this weight where it is stored in pieces (verify_hash.pieces)."""
        return None


class _Named(_Side):
    """A side whose tensors carry Hugging Face names: read by the names transformers' modules have."""

    def __init__(self, source: Source, dtype: torch.dtype | None, hashed: Hashed | None, output: bool,
                 buffers: _Buffers):
        super().__init__(source, dtype, hashed, output, buffers)
        # sources hand out one parameter's tensors at a time (q, k and v together for a torch_dist source)
        self.entry_of = {n: e.hf_names for e in iter_entries(source.dims(), 1, 1) for n in e.hf_names}
        self.cost = 0 if isinstance(source, HFSource) else 1
        self._pieces: dict[tuple[str, ...], list | None] = {}

    def _stored(self, name: str):
        if name not in self.entry_of:
            return None  # get() names it
        group = self.entry_of[name]
        if group not in self._pieces:  # a torch_dist tensor's chunks, as the source's own read would join them
            spans = self.source.spans(list(group)) if self.source.layout else None
            self._pieces = {group: spans and pieces(*spans)}
        stored = self._pieces[group]
        return stored and stored[group.index(name)]

    def get(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        # no compact copy (a torch_dist source's TP = 1 merges): hashed and loaded at once, then freed; a torch_dist
        # tensor of several chunks is assembled in a reused buffer
        with views(), merged_into(self.buffers):
            for group in dict.fromkeys(self.entry_of.get(n, (n,)) for n in names):
                out.update(zip(group, self.source.read(list(group))))
        if self.hashed is not None:
            for n in names:
                self.hashed.check(n, out[n], self.output)
        return {n: cast(out[n], self.dtype) for n in names}


class _Buffers:
    """The memory a side's merges (a Megatron side's TP shards, a torch_dist tensor's chunks) are written into, reused
    module after module (rules.merged_into): a fresh page costs this VM more than the copy into it
    (docs/performance.md). Buffers handed out since the last recycle() are in use; recycle() frees them for the next
    modules. The two sides share one set and take turns, and a side that merged nothing (a Hugging Face folder)
    recycles none: that keeps the free ones. Free buffers are kept while one of the last two modules used them: in a
    torch_dist checkpoint whose items lie back to back (as torch's writer puts them), a layer's tensors at odd
    offsets (copied into buffers) are not the next layer's, so the same shapes come every other layer. A shape with
    no free buffer drops those the last module did not use (the embeddings' shapes come once), so what it holds stays
    about one module's merges besides those in use."""

    def __init__(self):
        self.free: dict[tuple, list[tuple[torch.Tensor, int]]] = {}  # (shape, dtype) -> [(buffer, generation)]
        self.used: list[tuple[tuple, torch.Tensor]] = []
        self.generation = 0  # recycle() calls that freed something

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        spare = self.free.get((shape, dtype))
        if spare:
            buffer = spare.pop()[0]
        else:
            self._keep(self.generation)
            buffer = torch.empty(shape, dtype=dtype)
        self.used.append(((shape, dtype), buffer))
        return buffer

    def recycle(self) -> None:
        """Call only once nothing made since the last call is referenced any more."""
        if not self.used:
            return
        self.generation += 1
        for key, buffer in self.used:
            self.free.setdefault(key, []).append((buffer, self.generation))
        self.used = []
        self._keep(self.generation - 1)

    def _keep(self, oldest: int) -> None:
        """Drop the free buffers freed before generation `oldest`."""
        self.free = {k: kept for k, v in self.free.items() if (kept := [b for b in v if b[1] >= oldest])}


class _Megatron(_Side):
    """A Megatron side: each parameter merged from its TP shards by its rule, its parts placed by family.modules."""

    cost = 2

    def __init__(self, source: Source, dtype: torch.dtype | None, hashed: Hashed | None, output: bool,
                 buffers: _Buffers):
        super().__init__(source, dtype, hashed, output, buffers)
        tp, pp, vpp = source.layout
        dims = source.dims(tp)
        family = family_named(dims.family)
        table = family.modules or {}
        self.where: dict[str, tuple] = {}

        per_rank = dims.experts // source.ep if dims.experts else 1

        def add(pm, pp_rank: int, chunk: int, i: int = 0, j: int = 0) -> None:
            if pm.megatron_name not in table:
                raise ToolkitError(f"the {family.name} family has no modules entry for {pm.megatron_name}; add it to "
                                   f"toolkit/families/{family.name}.py so verification can read it")
            e = pm.expert or 0  # a routed expert: {e} in the table, on ep rank e // per_rank as local index {x}
            for part in pm.rule.parts:
                self.where[table[pm.megatron_name][part].format(i=i, e=e)] = (
                    pp_rank, chunk, pm.megatron_name.format(j=j, x=e % per_rank), pm.rule, part,
                    e // per_rank if pm.expert is not None else 0)

        add(family.embedding(dims), *first_stage())
        per_layer = family.layer(dims)
        for i in range(dims.layers):
            p, c, j = layer_location(i, dims.layers, pp, vpp)
            for pm in per_layer:
                add(pm, p, c, i, j)
        add(family.final_norm(dims), *last_stage(pp, vpp))
        if not dims.tied:
            add(family.output(dims), *last_stage(pp, vpp))
        self._pieces: dict[tuple, dict | None] = {}

    def get(self, names: list[str]) -> dict[str, torch.Tensor]:
        out, merged = {}, {}
        for n in names:
            if n not in self.where:
                raise ToolkitError(f"verification: transformers' model has {n}, which the Megatron side does not hold")
            p, c, m, rule, part, e = self.where[n]
            if (p, c, m, e) not in merged:
                # no compact copy: load_state_dict(assign=True) takes the views as they are
                with views(), merged_into(self.buffers):
                    whole = rule.merge([self.source._get(p, t, chunk_key(c, m), e)
                                        for t in range(self.source.layout[0])])
                merged[(p, c, m, e)] = dict(zip(rule.parts, whole if isinstance(whole, tuple) else (whole,)))
            if self.hashed is not None:
                self.hashed.check(n, merged[(p, c, m, e)][part], self.output)
            out[n] = cast(merged[(p, c, m, e)][part], self.dtype)
        return out

    def _stored(self, name: str):
        if name not in self.where:
            return None  # get() names it
        p, c, m, rule, part, e = self.where[name]
        if (p, c, m, e) not in self._pieces:  # the shards' bytes in their files, merged by the rule on addresses
            inputs = [self.source.shard_input(p, t, chunk_key(c, m), e) for t in range(self.source.layout[0])]
            stored = None if None in inputs else pieces(inputs, rule.merge)
            self._pieces = {(p, c, m, e): stored and dict(zip(rule.parts, stored))}
        stored = self._pieces[(p, c, m, e)]
        return stored and stored[part]


def side(source: Source, dtype: torch.dtype | None, hashed: Hashed | None = None, output: bool = False,
         buffers: _Buffers | None = None):
    """Sharded Megatron sources (the toolkit's layout, Megatron-LM's legacy files) are read shard by shard through
    the modules table; a torch_dist source holds whole tensors and is read through the map (so for it a mistake in
    the map itself would cancel out on its side)."""
    if source.layout and hasattr(source, "_get"):
        return _Megatron(source, dtype, hashed, output, buffers or _Buffers())
    return _Named(source, dtype, hashed, output, buffers or _Buffers())


def verify_logits(reference: Source, output: Source, dtype: torch.dtype, hf_folder: Path | None, log,
                  hash_weights: bool = False, written: torch.dtype | None = None) -> set[tuple[str, str]]:
    """Run the fixed tokens through transformers' model, one module at a time.

    With hash_weights=True (and `written`, the conversion's cast), each module's weights are first read from the
    reference and hashed, then the output's, which must hash the same (with the same shape and dtype; Hashed), and
    one side's weights run (`runs`: the cheaper side's, the output's on a tie): the other side's forward would
    repeat it bit for bit, on these tokens and on any other, so it is not run, and that side is only hashed (in
    place where its weights lie in pieces). Returns the (name, field) pairs of the output so proved, which the
    read-back then need not read again. With hash_weights=False both sides run and their hidden states must agree
    after every module."""
    join_import()  # transformers' lazy module is not safe to import from two threads at once
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: heavy; only the logit check needs it
    from transformers.masking_utils import create_causal_mask  # lazy: as above

    t0 = time.monotonic()
    if hf_folder is not None:  # the folder's own config.json, as a user's from_pretrained reads it
        config = AutoConfig.from_pretrained(hf_folder)
    else:
        config = AutoConfig.for_model(reference.config["model_type"], **_fields(reference.config))
        if reference.rows is not None:  # the padding rows carried between Megatron layouts are compared too
            config.vocab_size = reference.rows
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    hashed = Hashed(written) if hash_weights else None
    buffers = _Buffers()  # the two sides take turns (each is done with its tensors before the other reads): one set
    inner, sides = model.model, (side(reference, dtype, hashed, buffers=buffers),
                                 side(output, dtype, hashed, output=True, buffers=buffers))
    family = family_named(reference.dims().family)
    fused = family.in_memory or (lambda name, dims: None)  # transformers' tensors made of several stored ones
    dims = reference.dims()

    def fetch(which, names: list[str], hash_only: bool = False) -> dict[str, torch.Tensor]:
        made = {n: fused(n, dims) for n in names}
        if hash_only:  # what is stored: a fused tensor's parts
            which.hash_only([n for n in names if made[n] is None] + [p for m in made.values() if m for p in m[0]])
            return {}
        state = which.get([n for n in names if made[n] is None])
        for n, spec in made.items():
            if spec is not None:
                parts, combine = spec
                got = which.get(list(parts))
                state[n] = combine([got[p] for p in parts])
        return state

    # with the weights hashed, one side's forward is run (its records equal the other's): the one whose weights
    # cost least to hand out (a Hugging Face folder's are views of its mapped files, a Megatron side's are merged)
    runs = 0 if hashed is not None and sides[0].cost < sides[1].cost else 1
    ids = torch.randint(0, config.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(TOKENS).unsqueeze(0)

    def run(path: str, module: torch.nn.Module, which, x, weights: str | None = None, state=None,
            **kw) -> torch.Tensor:
        """Give `module` (at `path` in the model) its weights from one side (stored under `weights`, else
        `path`; or `state`, read from that side already), run it on x and drop the weights again."""
        weights = weights or path
        if state is None:
            with mapped():  # safetensors files: maps of the cached pages, not copies; gone with the module's weights
                state = fetch(which, [f"{weights}.{k}" for k in module.state_dict()])
        try:
            module.load_state_dict({k[len(weights) + 1:]: v for k, v in state.items()}, strict=True, assign=True)
        except RuntimeError as e:
            if hashed is not None:
                hashed.settle()  # a tensor that differs from the source's is named first
            raise ToolkitError(f"verification failed: {path} does not take the weights read for it: {e}; nothing was "
                               "written") from None
        del state
        with torch.no_grad():  # while the hash threads finish this module's records (done() waits for them)
            y = module(x, **kw)
        module.to("meta")  # drop the weights: memory stays at one module
        which.done()
        release()
        return y

    def step(what: str, path: str, module: torch.nn.Module, xs: list[torch.Tensor], weights: str | None = None,
             **kw) -> list[torch.Tensor]:
        """`module` run on each side's input; with the weights hashed, the reference's weights are read and hashed
        first, then the output's, which must hash the same, and one side's are run (`runs`); the other's are only
        hashed, in place where they are stored in pieces."""
        if hashed is None:
            ys = [run(path, module, s, x, weights, **kw) for s, x in zip(sides, xs)]
            compare(what, *ys)
            return ys
        names = [f"{weights or path}.{k}" for k in module.state_dict()]
        with mapped():
            state = fetch(sides[0], names, hash_only=runs == 1)  # hashed (and kept, when it runs)
        if runs == 1:
            if buffers.used:  # it merged some (replicated copies, a cast): free them for the output's merges
                sides[0].done()
            return [run(path, module, sides[1], xs[-1], weights, **kw)]
        with mapped():
            fetch(sides[1], names, hash_only=True)
        y = run(path, module, sides[0], xs[-1], weights, state=state, **kw)
        sides[1].done()
        return [y]

    def compare(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.equal(a, b):
            raise ToolkitError(f"verification failed: after {what}, transformers' model gives values up to "
                               f"{(a.float() - b.float()).abs().max().item():.3g} apart with the output's weights "
                               "and with the source's (a mapping or conversion error); nothing was written")

    try:
        h = step("the embeddings", "model.embed_tokens", inner.embed_tokens, [ids, ids])
        rotary = type(inner.rotary_emb)(config=model.config)  # its inv_freq is computed, not stored
        pe = rotary(h[0], pos)
        mask = create_causal_mask(config=model.config, inputs_embeds=h[0], attention_mask=None, cache=None,
                                  position_ids=pos)
        for i, layer in enumerate(inner.layers):
            h = step(f"decoder layer {i} (model.layers.{i})", f"model.layers.{i}", layer, h, attention_mask=mask,
                     position_embeddings=pe, position_ids=pos)
        h = step("the final norm", "model.norm", inner.norm, h)
        head = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"  # tied: the embeddings, read again
        step("the output layer (the logits)", "lm_head", model.lm_head, h, weights=head)
        took = time.monotonic() - t0
        if hashed is None:
            log(f"verified: transformers' {type(model).__name__} gives the source's logits on {TOKENS} fixed tokens, "
                f"layer by layer ({len(inner.layers)} layers, one in memory at a time; {took:.1f} s)")
            return set()
        note = cast_note(reference, written, " (its weights cast to ", ", as --dtype asks)")
        source = "the cast source" if note else "the source"
        log(f"verified: transformers' {type(model).__name__} gives the source's logits{note}: it ran the "
            f"{('source', 'output')[runs]}'s weights on {TOKENS} fixed tokens, layer by layer ({len(inner.layers)} "
            f"layers, one in memory at a time), and each of the {len(hashed.proved)} weights it loaded is "
            f"bit-identical in {source} and the output, so is every logit, on any input ({took:.1f} s)")
        return hashed.proved
    finally:
        if hashed is not None:
            hashed.close()


def verify_output(source: Source, written: Path, fields: tuple[str, ...], cast_to: torch.dtype | None, log,
                  digests: Digests, hf_folder: Path | None) -> None:
    """The verification of a conversion's output (the module docstring), for both of convert's paths: transformers'
    model must give the same logits with the output's weights as with the source's, and every tensor of the output
    read back must hash as the source's did (the weights on the logit check's reads, the rest read again after it).
    `written`: the output's folder (a Hugging Face one is `hf_folder` too); memory one layer."""
    # the manifest's checksums were just taken from these files (hashing them again would prove nothing the tensors'
    # read-back does not)
    output_source = open_output(source, written)
    try:
        changed = model_differences(source.config, output_source.config)
        if changed:  # what a Megatron-LM or torch_dist target's args could not say (the weights cannot show it)
            raise ToolkitError(f"verification failed: the output's config makes another model: {'; '.join(changed)}; "
                               "nothing was written")
        proved = verify_logits(source, output_source, cast_to or source.dtype(), hf_folder, log, True, cast_to)
    finally:
        output_source.close()
    read_back(source, written, fields, digests, log, proved or set(), cast_to)  # the optimizer state, any weight left
