"""A DPO run's report: its rewards and reward accuracy as plots of their own and as summary cells; an SFT run's
report has neither. The rows have the keys and shape the recipe writes to metrics.jsonl and summary.json."""

from trainlift import report

START = {"event": "start", "step": 0, "total_steps": 6, "resumed_from": None, "world": 2, "time": 100.0,
         "trainable_params": 824704, "total_params": 824704, "attention": "sdpa",
         "mesh": {"replicate": 1, "shard": 2, "why": "plain FSDP: one node"}, "objective": "dpo"}


def reference(split, examples):
    return {"event": "reference", "step": 0, "split": split, "examples": examples, "scored": True, "seconds": 3.59,
            "time": 103.6}


def step(n, loss, chosen, rejected, accuracy):
    return {"step": n, "loss": loss, "lr": 1e-3, "grad_norm": 1.16, "world": 2, "tokens": 1646.0,
            "tokens_per_s": 3582.1, "step_time_s": 0.46, "flops_per_token": 5113977.6, "mfu": None,
            "rewards/chosen": chosen, "rewards/rejected": rejected, "rewards/margin": chosen - rejected,
            "rewards/accuracy": accuracy, "time": 104.0 + n}


def evaluation(n, loss, chosen, rejected, accuracy):
    return {"step": n, "eval_loss": loss, "eval_rewards/chosen": chosen, "eval_rewards/rejected": rejected,
            "eval_rewards/margin": chosen - rejected, "eval_rewards/accuracy": accuracy, "time": 104.5 + n}


ROWS = [START, reference("train", 2000), reference("eval", 200), evaluation(0, 0.6931, 0.0, 0.0, 0.0),
        step(1, 0.6931, 0.0, 0.0, 0.0), step(2, 0.5137, -0.0584, -0.4656, 1.0),
        step(3, 0.4089, -0.0549, -0.7662, 0.9375), evaluation(3, 0.3166, -0.1406, -1.1734, 1.0),
        step(4, 0.3321, -0.1941, -1.1701, 1.0), step(5, 0.2926, -0.1183, -1.2488, 1.0),
        step(6, 0.2349, -0.2660, -1.6762, 0.96875),
        {"event": "checkpoint", "step": 6, "checkpoint_blocked_s": 0.198, "time": 110.9},
        evaluation(6, 0.1909, -0.2187, -1.8872, 1.0)]
SUMMARY = {"finished": True, "steps": 6, "final_loss": 0.2349, "initial_eval_loss": 0.6931, "eval_loss": 0.1909,
           "eval_rewards/accuracy": 1.0, "eval_rewards/chosen": -0.2187, "eval_rewards/margin": 1.6686,
           "eval_rewards/rejected": -1.8872, "tokens_per_s": 3871.8, "step_time_s": 0.422, "mfu": None,
           "world_size": 2, "device": "cpu", "objective": "dpo", "resumed_from": None, "wall_time_s": 48.0}


def lines(fig) -> dict[str, tuple[list, list, str, str]]:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()), line.get_color(), line.get_linestyle())
            for line in fig.axes[0].get_lines()}


def test_a_dpo_report_plots_the_rewards_and_the_reward_accuracy_beside_the_loss():
    page, pngs = report.build([("tiny-dpo", ROWS, SUMMARY)])
    assert list(pngs) == ["loss", "rewards", "reward_accuracy", "lr", "tokens_per_s"]
    assert page.count("data:image/png;base64,") == 5
    figs = report.figures([("tiny-dpo", ROWS)])
    rewards = lines(figs["rewards"])
    assert list(rewards) == ["chosen", "rejected", "margin"]
    assert rewards["margin"][0] == [1, 2, 3, 4, 5, 6] and abs(rewards["margin"][1][-1] - 1.4102) < 1e-9
    assert len({color for _, _, color, _ in rewards.values()}) == 3  # one run: a colour per curve
    accuracy = lines(figs["reward_accuracy"])
    assert accuracy["train"][:2] == ([1, 2, 3, 4, 5, 6], [0.0, 1.0, 0.9375, 1.0, 1.0, 0.96875])
    assert accuracy["eval"][:2] == ([0, 3, 6], [0.0, 1.0, 1.0]) and accuracy["eval"][3] == "--"
    assert figs["reward_accuracy"].axes[0].get_ylim() == report.Y_LIMITS["reward_accuracy"]


def test_a_dpo_reports_table_has_its_train_and_eval_reward_cells_after_the_eval_loss():
    page, _ = report.build([("tiny-dpo", ROWS, SUMMARY)])
    table = page.split("<table>", 1)[1].split("</table>", 1)[0]
    cells = ["<th>eval_loss</th><td>0.1909</td>", "<th>final_rewards/accuracy</th><td>96.9%</td>",
             "<th>final_rewards/margin</th><td>1.410</td>", "<th>eval_rewards/accuracy</th><td>100.0%</td>",
             "<th>eval_rewards/margin</th><td>1.669</td>", "<th>tokens_per_s</th>"]
    assert all(cell in table for cell in cells)
    assert [table.index(cell) for cell in cells] == sorted(table.index(cell) for cell in cells)


def test_a_running_dpo_run_without_a_summary_still_gets_its_last_steps_rewards():
    values = report.table_values(ROWS[:-2], None)
    assert values["final_rewards/accuracy"] == 0.96875
    assert values["eval_rewards/accuracy"] == 1.0 and values["eval_step"] == 3  # its last evaluation's, as recorded
    assert values["initial_eval_loss"] == 0.6931


def sft_rows():
    rows = [{**r, "objective": "sft"} if r.get("event") == "start" else r
            for r in ROWS if r.get("event") != "reference"]
    return [{k: v for k, v in r.items() if "rewards/" not in k} for r in rows]


def test_an_sft_report_has_no_reward_plot_or_cell():
    summary = {k: v for k, v in SUMMARY.items() if "rewards/" not in k}
    page, pngs = report.build([("tiny-demo", sft_rows(), {**summary, "objective": "sft"})])
    assert list(pngs) == ["loss", "lr", "tokens_per_s"] and "rewards" not in page
    assert [key for key, _ in report.summary_keys([("tiny-demo", summary)])] == \
        [key for key, _ in report.SUMMARY_KEYS]


def test_compare_tells_the_runs_by_colour_and_the_reward_curves_by_line_style():
    later = [{**r, **{k: v * 2 for k, v in r.items() if k.startswith("rewards/") and k != "rewards/accuracy"}}
             for r in ROWS]
    rewards = lines(report.figures([("a", ROWS), ("b", later), ("sft", sft_rows())])["rewards"])
    assert list(rewards) == ["a chosen", "a rejected", "a margin", "b chosen", "b rejected", "b margin"]
    assert {rewards[f"a {s}"][2] for s in ("chosen", "rejected", "margin")} == {"C0"}
    assert {rewards[f"b {s}"][2] for s in ("chosen", "rejected", "margin")} == {"C1"}
    assert [rewards[f"a {s}"][3] for s in ("chosen", "rejected", "margin")] == ["-", "--", ":"]
    page, _ = report.build([("a", ROWS, SUMMARY), ("sft", sft_rows(), None)])
    assert "<th>eval_rewards/accuracy</th><td>100.0%</td><td>—</td>" in page
