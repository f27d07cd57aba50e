"""The pure parts of benches/batching.py: its summary and table (no workers, no model)."""

from __future__ import annotations


import pytest

batching = pytest.importorskip("batching")


def m(k, mode, batching_, tps, parity=True, decode=None):
    return {"sessions": k, "mode": mode, "batching": batching_, "aggregate_tps": tps,
            "tpot_ms_p50": 1000 / tps, "tpot_ms_max": 2000 / tps, "ttft_ms_p50": 5.0,
            "parity": parity, **({} if decode is None else {"decode_tps": decode})}


def test_the_decode_phase_against_s_tg_and_the_wall_against_end_to_end():
    """Like for like: dgr's decode-phase rate over batched-bench's S_TG (its generation
    phase), dgr's output tokens over the wall time (prefills included) over batched-bench's
    tokens over its prompt and generation phases; batched/solo by the decode phase."""
    res = {"dgr": [m(16, "batched", True, 100.0, decode=150.0),
                   m(16, "solo", False, 80.0, decode=100.0)],
           "llama_batched_bench": {"2": [{16: {"speed_tg": 160.0, "pl": 16, "tg": 64,
                                               "t_pp": 1.0, "t_tg": 16 * 64 / 160.0}}]}}
    (row,) = batching.summarize(res, [16], [2])
    assert row["batched_over_bb_t2"] == pytest.approx(150 / 160)
    e2e = 16 * 64 / (1.0 + 16 * 64 / 160.0)
    assert row["bb_e2e_t2"] == pytest.approx(e2e)
    assert row["batched_e2e_over_bb_t2"] == pytest.approx(100 / e2e)
    assert row["batched_over_solo"] == pytest.approx(1.5)
    head, _, cells = batching.table([row], [2], 2).splitlines()
    cols = dict(zip([c.strip() for c in head.strip("|").split("|")],
                    [c.strip() for c in cells.strip("|").split("|")]))
    assert cols["dgr2 batched tok/s"] == "150.0" and cols["dgr2 batched wall tok/s"] == "100.0"
    assert cols["batched/bb-t2"] == "0.94" and cols["batched-bench -t2 S_TG tok/s"] == "160.0"
    assert cols["wall/bb-t2 end-to-end"] == f"{100 / e2e:.2f}"


def test_summary_and_table_with_the_ungrouped_workers():
    res = {"dgr": [m(16, "batched", True, 110.0), m(16, "solo", False, 100.0),
                   m(16, "ungrouped", True, 88.0, parity=False)],
           "llama_batched_bench": {"2": [{16: {"speed_tg": 176.0}}]}}
    (row,) = batching.summarize(res, [16], [2])
    assert row["batched"]["aggregate_tps"] == 110.0 and row["ungrouped"]["aggregate_tps"] == 88.0
    assert row["batched_over_ungrouped"] == pytest.approx(1.25)
    assert row["batched_over_solo"] == pytest.approx(1.1)
    assert row["batched_over_bb_t2"] == pytest.approx(110 / 176)
    assert row["ungrouped"]["parity"] is False and row["batched"]["parity"] is True
    text = batching.table([row], [2], 3)
    head, _, cells = text.splitlines()
    cols = dict(zip([c.strip() for c in head.strip("|").split("|")],
                    [c.strip() for c in cells.strip("|").split("|")]))
    assert cols["dgr3 ungrouped tok/s"] == "88.0" and cols["batched/ungrouped"] == "1.25"
    assert cols["parity ungrouped"] == "False" and cols["batched/bb-t2"] == "0.62"


def test_the_pipeline_figure_is_the_whole_model_at_the_rows_each_stage_computes():
    """llama-batched-bench -t 1 at npl = ceil(k / stages) (the rows of a ring group), times
    the stages busy at once (at most k, the stages and the cores): what the whole model's
    own engine gives a pipeline of one-thread stages. 16 sessions on 2 stages: 2 x npl 8;
    on 3 stages over 2 cores: 2 x npl 6; one session: one stage at a time, npl 1."""
    bb1 = {1: {"speed_tg": 100.0}, 6: {"speed_tg": 200.0}, 8: {"speed_tg": 250.0},
           16: {"speed_tg": 350.0}}
    res = {"meta": {"stages": 2, "cpu_count": 2},
           "dgr": [m(1, "batched", True, 90.0), m(1, "solo", False, 90.0),
                   m(16, "batched", True, 450.0), m(16, "solo", False, 250.0)],
           "llama_batched_bench": {"1": [bb1], "2": [{1: {"speed_tg": 150.0},
                                                      16: {"speed_tg": 700.0}}]}}
    one, many = batching.summarize(res, [1, 16], [1, 2])
    assert one["pipeline_tps"] == pytest.approx(100.0)
    assert many["pipeline_tps"] == pytest.approx(500.0)
    assert many["batched_over_pipeline"] == pytest.approx(0.9)
    assert many["batched_over_bb_t2"] == pytest.approx(450 / 700)
    head, _, _, cells = batching.table([one, many], [1, 2], 2).splitlines()
    cols = dict(zip([c.strip() for c in head.strip("|").split("|")],
                    [c.strip() for c in cells.strip("|").split("|")]))
    assert cols["bb -t1 pipeline tok/s"] == "500.0" and cols["batched/bb-t1 pipeline"] == "0.90"
    res["meta"] = {"stages": 3, "cpu_count": 2}
    (many,) = batching.summarize(res, [16], [1, 2])
    assert many["pipeline_tps"] == pytest.approx(400.0)
    assert batching.pipeline_npl([1, 16, 32], 3) == [1, 6, 11, 16, 32]
    del res["llama_batched_bench"]["1"]  # no -t 1 run: no pipeline figure, no column
    (many,) = batching.summarize(res, [16], [2])
    assert "pipeline_tps" not in many
    assert "pipeline" not in batching.table([many], [2], 3)


def test_results_without_modes_still_summarize():
    """A results file from before the ungrouped mode (no "mode" keys) reads as before."""
    res = {"dgr": [{k: v for k, v in m(4, "batched", True, 60.0).items() if k != "mode"},
                   {k: v for k, v in m(4, "solo", False, 50.0).items() if k != "mode"}],
           "llama_batched_bench": {}}
    (row,) = batching.summarize(res, [4], [])
    assert row["batched"]["aggregate_tps"] == 60.0 and row["solo"]["aggregate_tps"] == 50.0
    assert "ungrouped" not in row and "batched/ungrouped" not in batching.table([row], [], 3)


def test_a_stages_profile_and_the_bound_of_its_engines_alone():
    """Two scrapes of a worker's metrics give its share per output token; the stages' engines
    alone bound the route (the slowest stage, or the cores over their sum when the stages
    outnumber the cores); the summary and the breakdown table show both."""
    before = {"process_cpu_seconds_total": 1.0, "dgr_engine_decode_seconds_total": 0.5,
              "dgr_engine_forwards_total": 10.0, "dgr_engine_ubatches_total": 10.0,
              "dgr_engine_graphs_reused_total": 5.0, "dgr_worker_batches_total": 10.0,
              "dgr_worker_batched_steps_total": 10.0,
              'dgr_worker_stage_seconds_total{part=engine}': 0.5,
              'dgr_worker_stage_seconds_total{part=idle}': 2.0}
    after = {**before, "process_cpu_seconds_total": 2.0, "dgr_engine_decode_seconds_total": 1.3,
             "dgr_engine_forwards_total": 30.0, "dgr_engine_ubatches_total": 40.0,
             "dgr_worker_batches_total": 30.0, "dgr_worker_batched_steps_total": 90.0,
             'dgr_worker_stage_seconds_total{part=engine}': 1.4,
             'dgr_worker_stage_seconds_total{part=idle}': 2.5,
             "dgr_worker_decode_steps_total": 80.0,
             "dgr_worker_decode_compute_seconds_total": 0.6}
    st = batching.stage_profile(before, after, tokens=100)
    # the engine's share of each decode step's forward: 0.6 s over 80 steps (the prompts'
    # compute left out), what the stage's engine alone measures
    assert st["engine_ms_per_decode_step"] == pytest.approx(7.5)
    assert batching.stage_profile(before, before, tokens=1)["engine_ms_per_decode_step"] is None
    assert st["cpu_ms_per_token"] == pytest.approx(10.0)
    assert st["ms_per_token"] == {"engine": pytest.approx(9.0), "idle": pytest.approx(5.0)}
    assert st["steps_per_forward"] == pytest.approx(4.0)
    assert st["ubatches_per_forward"] == pytest.approx(1.5)
    assert st["graphs_reused_per_forward"] == 0.0
    assert batching.bound_tps([5.0, 4.0], cores=2) == pytest.approx(200.0)
    assert batching.bound_tps([5.0, 4.0, 1.0], cores=2) == pytest.approx(200.0)  # 2/10 ms
    assert batching.bound_tps([5.0, 4.0, 3.0], cores=2) == pytest.approx(2000 / 12)
    mb = {**m(16, "batched", True, 150.0), "driver_cpu_ms_per_token": 0.2, "stages": [st, st]}
    ms = {**m(16, "solo", False, 100.0), "driver_cpu_ms_per_token": 0.3, "stages": [st, st]}
    res = {"meta": {"stages": 2, "cpu_count": 2}, "dgr": [mb, ms],
           "stage_bounds": [{"1": 6.0, "8": 5.0}, {"1": 7.0, "8": 4.0}],
           "llama_batched_bench": {}}
    (row,) = batching.summarize(res, [16], [])
    assert row["bound_tps"] == pytest.approx(200.0)
    assert row["batched"]["stage_cpu_ms_per_token"] == {"0": pytest.approx(10.0),
                                                        "1": pytest.approx(10.0)}
    assert row["batched_over_bound"] == pytest.approx(0.75)
    text = batching.breakdown(res)
    assert "| 16 | batched | 0 | 10.00 | 9.00 |" in text and "| 7.50 | 5.00 (b=8) |" in text
    assert "| 16 | solo | 1 | 10.00 |" in text and "7.00 (b=1)" in text
    assert "| 16 | batched | driver | 0.20 |" in text


ring_trace = pytest.importorskip("ring_trace")


def span(st, batch, n, end, compute, arrive=1.0):
    return {"st": st, "batch": batch, "n": n, "compute_end": end, "compute_s": compute,
            "arrive": arrive}


def test_ring_trace_counts_forwards_by_size_and_stages_at_once():
    spans = [span(0, 1, 1, 2.0, 0.5), span(0, 1, 1, 2.0, 0.5),  # stage 0: [1, 2], 2 steps
             span(1, 7, 1, 3.0, 1.0),  # stage 1: [2, 3], 1 step
             span(2, 2, 1, 3.5, 1.0), span(2, 2, 1, 3.5, 1.0),  # stage 2: [1.5, 3.5]
             span(0, 3, 8, 9.0, 1.0),  # a prefill chunk: not a decode forward
             span(0, 4, 1, 0.5, 0.1, arrive=0.0)]  # before the run: ignored
    assert ring_trace.batch_sizes(spans, 0, 0.5) == {2: 1}
    assert ring_trace.batch_sizes(spans, 1, 0.5) == {1: 1}
    assert ring_trace.batch_sizes(spans, 2, 0.5) == {2: 1}
    share = ring_trace.concurrency([s for s in spans if s["n"] == 1], 0.5)
    # from 1.0 to 3.5: one stage 1.0-1.5 and 3.0-3.5, two 1.5-2.0 and 2.0-3.0 (0 never)
    assert share == pytest.approx({0: 0.0, 1: 0.4, 2: 0.6})


def test_the_stages_balance_is_each_one_alone_at_the_ring_groups_rows():
    """16 sessions on 2 stages: ring groups of 8 rows; the slowest stage over the fastest."""
    res = {"meta": {"stages": 2, "settings": {"n_slots": 16}},
           "stage_bounds": [{"1": 1.0, "8": 0.5}, {"1": 0.9, "8": 0.6}]}
    text = batching.balance(res)
    assert "alone at 8 rows: 0.500, 0.600 ms/token" in text and "slowest/fastest 1.20" in text
    assert batching.balance({"meta": {"stages": 1}, "stage_bounds": [{"1": 1.0}]}) == "one stage"
