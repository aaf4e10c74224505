"""Checkpoint mapping: split/merge rules, pipeline layer placement, and HF <-> Megatron Llama round trips on CPU."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from toolkit.families import (QKV, ColumnParallel, Dims, GatedMLP, Replicated, RowParallel, VocabParallel, dims_from_hf,
                              hf_to_megatron, megatron_to_hf)
from toolkit.layout import chunk_layers, global_layer, layer_location, padded_vocab_size
from toolkit.errors import ToolkitError


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


# --- rules -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("rule, shape, dim", [(ColumnParallel(), (8, 12), 0), (RowParallel(), (12, 8), 1)])
def test_column_and_row_parallel_split_the_right_dim_and_merge_exactly(rule, shape, dim, tp):
    full = _rand(*shape)
    shards = rule.split(full, tp)
    assert len(shards) == tp and all(s.shape[dim] == 8 // tp and s.is_contiguous() for s in shards)
    assert torch.equal(rule.merge(shards), full)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_replicated_gives_every_rank_the_full_tensor(tp):
    full = _rand(16)
    shards = Replicated().split(full, tp)
    assert len(shards) == tp and all(torch.equal(s, full) for s in shards)
    assert torch.equal(Replicated().merge(shards), full)


def test_shards_and_merged_tensors_own_compact_storage():
    # torch.save writes a view's whole storage, so a shard that were a view would carry the full tensor to disk
    full = _rand(12, 8).to(torch.bfloat16)
    pieces = RowParallel().split(full, 4) + VocabParallel(12, 16).split(full, 2) + [VocabParallel(12, 16).merge(
        VocabParallel(12, 16).split(full, 2))]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in pieces)
    assert all(t.dtype == torch.bfloat16 for t in pieces)


def test_replicated_merge_rejects_ranks_that_disagree():
    with pytest.raises(ToolkitError, match="tp rank 1"):
        Replicated().merge([torch.zeros(4), torch.ones(4)])


def test_split_rejects_a_tp_that_does_not_divide():
    with pytest.raises(ToolkitError, match="not divisible by 4"):
        ColumnParallel().split(_rand(6, 2), 4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_pads_with_zero_rows_and_merge_drops_exactly_the_padding(tp):
    full = _rand(10, 3) + 5  # no row of the real vocabulary is zero
    shards = VocabParallel(10, 16).split(full, tp)
    assert [s.shape for s in shards] == [(16 // tp, 3)] * tp
    padded = torch.cat(shards)
    assert torch.equal(padded[:10], full) and torch.equal(padded[10:], torch.zeros(6, 3))
    merged = VocabParallel(10, 16).merge(shards)
    assert merged.shape == (10, 3) and torch.equal(merged, full)


def test_vocab_parallel_rejects_shards_with_another_padding():
    with pytest.raises(ToolkitError, match="padded vocab 16"):
        VocabParallel(10, 16).merge([torch.zeros(12, 3)])


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("heads, kv", [(8, 2), (4, 4)])  # GQA and MHA
def test_qkv_round_trip(heads, kv, tp):
    d, h = 4, 6
    q, k, v = _rand(heads * d, h), _rand(kv * d, h) + 1, _rand(kv * d, h) + 2
    shards = QKV(heads, kv, d).split((q, k, v), tp)
    assert [s.shape for s in shards] == [((heads + 2 * kv) * d // tp, h)] * tp
    merged = QKV(heads, kv, d).merge(shards)
    assert all(torch.equal(a, b) for a, b in zip(merged, (q, k, v)))


def test_qkv_layout_is_grouped_per_query_group_and_tp_splits_whole_groups():
    # head_dim 1: query head n holds value n, kv group g holds 10 + g (k) and 20 + g (v)
    q, k, v = torch.arange(4.0)[:, None], torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    [full] = QKV(4, 2, 1).split((q, k, v), 1)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    rank0, rank1 = QKV(4, 2, 1).split((q, k, v), 2)
    assert rank0.flatten().tolist() == [0, 1, 10, 20] and rank1.flatten().tolist() == [2, 3, 11, 21]


def test_qkv_layout_for_multi_head_attention():
    q, k, v = torch.tensor([[0.0], [1.0]]), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    [full] = QKV(2, 2, 1).split((q, k, v), 1)
    assert full.flatten().tolist() == [0, 10, 20, 1, 11, 21]


def test_qkv_with_more_tp_ranks_than_kv_heads_splits_groups_in_contiguous_blocks():
    # Megatron allows tp a multiple of the kv heads: each rank stores a block of the grouped rows, and the forward
    # gathers the group back together
    q, k, v = torch.arange(4.0)[:, None], torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    shards = QKV(4, 2, 1).split((q, k, v), 4)
    assert [s.flatten().tolist() for s in shards] == [[0, 1], [10, 20], [2, 3], [11, 21]]
    assert all(torch.equal(a, b) for a, b in zip(QKV(4, 2, 1).merge(shards), (q, k, v)))


def test_qkv_rejects_a_tp_megatron_cannot_split_attention_over():
    with pytest.raises(ToolkitError, match="divisor or multiple of the kv heads"):
        QKV(12, 4, 4).split((_rand(48, 6), _rand(16, 6), _rand(16, 6)), 6)


def test_gated_mlp_puts_gate_shard_then_up_shard_on_each_rank():
    gate, up = torch.arange(4.0)[:, None], torch.arange(10.0, 14.0)[:, None]
    rank0, rank1 = GatedMLP().split((gate, up), 2)
    assert rank0.flatten().tolist() == [0, 1, 10, 11] and rank1.flatten().tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_mlp_round_trip(tp):
    gate, up = _rand(8, 6), _rand(8, 6) + 1
    merged = GatedMLP().merge(GatedMLP().split((gate, up), tp))
    assert torch.equal(merged[0], gate) and torch.equal(merged[1], up)


@pytest.mark.parametrize("vocab, tp, expected", [(500, 1, 512), (500, 2, 512), (500, 4, 512), (513, 1, 640),
                                                 (128, 1, 128), (32000, 1, 32000), (32000, 8, 32768)])
def test_padded_vocab_size_is_the_next_multiple_of_128_tp(vocab, tp, expected):
    assert padded_vocab_size(vocab, tp) == expected


# --- pipeline placement ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layers, pp, vpp", [(4, 1, 1), (4, 2, 1), (4, 2, 2), (8, 4, 2), (80, 4, 5)])
def test_layer_location_and_global_layer_are_inverse(layers, pp, vpp):
    seen = set()
    for layer in range(layers):
        where = layer_location(layer, layers, pp, vpp)
        assert global_layer(*where, layers, pp, vpp) == layer
        seen.add(where)
    per_chunk = layers // (pp * vpp)
    assert seen == {(p, c, j) for p in range(pp) for c in range(vpp) for j in range(per_chunk)}


def test_interleaved_chunks_hold_the_megatron_layers():
    # pp 2, vpp 2: every rank takes one chunk, then every rank takes a second one
    assert list(chunk_layers(0, 0, 8, 2, 2)) == [0, 1]
    assert list(chunk_layers(1, 0, 8, 2, 2)) == [2, 3]
    assert list(chunk_layers(0, 1, 8, 2, 2)) == [4, 5]
    assert list(chunk_layers(1, 1, 8, 2, 2)) == [6, 7]
    assert layer_location(5, 8, 2, 2) == (0, 1, 1)


def test_layer_placement_rejects_layers_that_do_not_split_evenly():
    with pytest.raises(ToolkitError, match="pp x vpp = 2 x 2 = 4"):
        layer_location(0, 6, 2, 2)


# --- HF <-> Megatron Llama ---------------------------------------------------------------------------------------

LAYOUTS = {"TP1PP1": (1, 1, 1), "TP2PP2": (2, 2, 1), "TP4PP1": (4, 1, 1), "TP1PP2VPP2": (1, 2, 2),
           "TP2PP1": (2, 1, 1)}


def _tiny_config(tied: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=tied)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny_llama(request):
    torch.manual_seed(0)
    config = _tiny_config(request.param)
    # Norm weights start at exactly 1; perturb them so a mixed-up norm could not round-trip by accident
    state = {k: v + torch.rand_like(v) if "norm" in k else v for k, v in LlamaForCausalLM(config).state_dict().items()}
    if request.param:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return config, state


def _expected_shapes(dims: Dims, tp: int, pp: int, vpp: int) -> dict[tuple[int, int], dict[str, tuple]]:
    """Per (pp_rank, chunk), the Megatron (local spec) names and per-TP-rank shapes, written from the layout spec."""
    h, d, per_chunk = dims.hidden, dims.head_dim, dims.layers // (pp * vpp)
    layer = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
             "self_attention.linear_qkv.weight": ((dims.heads + 2 * dims.kv_heads) * d // tp, h),
             "self_attention.linear_proj.weight": (h, dims.heads * d // tp),
             "mlp.linear_fc1.weight": (2 * dims.ffn // tp, h), "mlp.linear_fc2.weight": (h, dims.ffn // tp)}
    shapes = {(p, c): {f"decoder.layers.{j}.{n}": s for j in range(per_chunk) for n, s in layer.items()}
              for p in range(pp) for c in range(vpp)}
    shapes[(0, 0)]["embedding.word_embeddings.weight"] = (dims.padded_vocab // tp, h)
    shapes[(pp - 1, vpp - 1)]["decoder.final_layernorm.weight"] = (h,)
    if not dims.tied or pp > 1:
        shapes[(pp - 1, vpp - 1)]["output_layer.weight"] = (dims.padded_vocab // tp, h)
    return shapes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_to_megatron_gives_every_shard_the_megatron_shape(tiny_llama, layout):
    config, state = tiny_llama
    tp, pp, vpp = LAYOUTS[layout]
    dims = dims_from_hf(config, tp=tp)
    shards = hf_to_megatron(state, dims, tp, pp, vpp)
    assert set(shards) == {(p, r) for p in range(pp) for r in range(tp)}
    expected = _expected_shapes(dims, tp, pp, vpp)
    for (p, r), chunks in shards.items():
        assert len(chunks) == vpp
        for c, chunk in enumerate(chunks):
            assert {n: tuple(t.shape) for n, t in chunk.items()} == expected[(p, c)], (p, r, c)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_shapes_without_tensors_equal_the_real_split(tiny_llama, layout):
    """The streaming converter lays out its files from rule.shard_shape (no tensors): it must equal split's."""
    from toolkit.checkpoint.safetensors_sources import meta_shards

    config, state = tiny_llama
    tp, pp, vpp = LAYOUTS[layout]
    dims = dims_from_hf(config, tp=tp)
    expected = _expected_shapes(dims, tp, pp, vpp)
    got = meta_shards(dims, tp, pp, vpp)
    assert set(got) == {(p, r) for p in range(pp) for r in range(tp)}
    for (p, r), shapes in got.items():
        want = {f"chunk{c}.{n}": s for c in range(vpp) for n, s in expected[(p, c)].items()}
        assert shapes == want, (p, r)


def test_views_mode_shares_storage_and_gives_equal_shards(tiny_llama):
    from toolkit.families.rules import views

    config, state = tiny_llama
    dims = dims_from_hf(config, tp=2)
    compact = hf_to_megatron(state, dims, 2, 1)
    with views():
        shared = hf_to_megatron(state, dims, 2, 1)
    emb = "embedding.word_embeddings.weight"
    assert shared[(0, 1)][0]["decoder.layers.0.input_layernorm.weight"].data_ptr() == \
        state["model.layers.0.input_layernorm.weight"].data_ptr()  # a view, no copy
    assert compact[(0, 1)][0][emb].untyped_storage().nbytes() == compact[(0, 1)][0][emb].nbytes
    assert all(torch.equal(shared[k][0][n], t) for k, chunks in compact.items() for n, t in chunks[0].items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hf_to_megatron_to_hf_is_bit_exact(tiny_llama, layout):
    config, state = tiny_llama
    tp, pp, vpp = LAYOUTS[layout]
    dims = dims_from_hf(config, tp=tp)
    back = megatron_to_hf(hf_to_megatron(state, dims, tp, pp, vpp), dims, tp, pp, vpp)
    want = {k: v for k, v in state.items() if not (dims.tied and k == "lm_head.weight")}
    assert set(back) == set(want)
    assert all(torch.equal(back[k], want[k]) and back[k].dtype == want[k].dtype for k in want)


def test_tied_output_layer_on_the_last_stage_copies_the_embedding_shard(tiny_llama):
    config, state = tiny_llama
    dims = dims_from_hf(config, tp=2)
    shards = hf_to_megatron(state, dims, tp=2, pp=2)
    for r in range(2):
        embedding = shards[(0, r)][0]["embedding.word_embeddings.weight"]
        output = shards[(1, r)][0]["output_layer.weight"]
        assert torch.equal(output, embedding) if dims.tied else not torch.equal(output, embedding)


def test_megatron_extra_state_entries_are_ignored(tiny_llama):
    config, state = tiny_llama
    dims = dims_from_hf(config, tp=2)
    shards = hf_to_megatron(state, dims, tp=2, pp=1)
    for chunks in shards.values():
        chunks[0]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = None
    back = megatron_to_hf(shards, dims, tp=2, pp=1)
    assert torch.equal(back["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.q_proj.weight"])
    assert not any(name.endswith("_extra_state") for chunks in hf_to_megatron(state, dims, 2, 1).values()
                   for name in chunks[0])


def test_llama_dims_from_config_object_and_from_dict_agree():
    config = _tiny_config(tied=True)
    dims = dims_from_hf(config, tp=4)
    assert dims == Dims(family="llama", hidden=64, heads=8, kv_heads=2, head_dim=8, ffn=96, layers=4, vocab=500,
                        padded_vocab=512, tied=True)
    assert dims_from_hf(config.to_dict(), tp=4) == dims
    plain = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 96,
             "num_hidden_layers": 4, "vocab_size": 500}
    assert dims_from_hf(plain) == Dims("llama", 64, 8, 8, 8, 96, 4, 500, 512, tied=False)


def test_llama_dims_name_every_missing_config_key():
    with pytest.raises(ToolkitError, match="intermediate_size, num_hidden_layers"):
        dims_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 500})


@pytest.mark.parametrize("model_type, needle", [(None, "has no model_type; add"), ("gpt2", "'gpt2' is not supported")])
def test_a_config_of_no_known_family_is_refused_with_the_families_listed(model_type, needle):
    config = {"hidden_size": 64, "num_attention_heads": 8, "intermediate_size": 96, "num_hidden_layers": 4,
              "vocab_size": 500, **({"model_type": model_type} if model_type else {})}
    with pytest.raises(ToolkitError, match=needle) as e:
        dims_from_hf(config)
    assert "llama" in str(e.value)


def test_conversion_errors_list_every_problem(tiny_llama):
    config, state = tiny_llama
    dims = dims_from_hf(config, tp=4)
    broken = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    broken["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    broken["model.norm.weight"] = torch.zeros(63)
    with pytest.raises(ToolkitError) as error:
        hf_to_megatron(broken, dims, tp=4, pp=1)
    message = str(error.value)
    assert "3 problems" in message and "up_proj.weight: missing" in message
    assert "q_proj.bias" in message and "has shape (63,), the dims give (64,)" in message


def test_conversion_rejects_a_layout_the_model_cannot_take(tiny_llama):
    config, state = tiny_llama
    dims = dims_from_hf(config, tp=16)
    with pytest.raises(ToolkitError, match="8 attention heads are not divisible by tp = 16") as error:
        hf_to_megatron(state, dims, tp=16, pp=3)
    assert "4 layers do not split into pp x vpp = 3 x 1" in str(error.value)


def test_megatron_to_hf_names_missing_shards(tiny_llama):
    config, state = tiny_llama
    dims = dims_from_hf(config, tp=2)
    shards = hf_to_megatron(state, dims, tp=2, pp=2)
    del shards[(1, 1)][0]["decoder.final_layernorm.weight"]
    with pytest.raises(ToolkitError, match="pp_rank 1, tp_rank 1, chunk 0: missing decoder.final_layernorm"):
        megatron_to_hf(shards, dims, tp=2, pp=2)
    with pytest.raises(ToolkitError, match="expected \\(pp_rank, tp_rank\\) keys"):
        megatron_to_hf(shards, dims, tp=2, pp=1)
