#!/usr/bin/python3
"""The trace checker (trace_rule.py) on synthetic traces: a run that follows the rule passes —
a strict job, and an elastic one with a member killed inside a call and a replacement admitted —
and every seeded violation fails, naming what is wrong: a checker that cannot fail proves
nothing. No processes, no root: label `unit`.

  trace_rule_test.py
"""

import copy
import math
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_rule  # noqa: E402


def simulate(world, steps, groups_at, killed=None, replacement=None):
    """Lines as trace workers print them, computed here step by step.

    groups_at(step, live) -> [[ranks averaging together], ...] (the rest skip); `killed`:
    (rank, step) — the rank dies inside its call at that step, after which its peers average
    without it from the next step; `replacement`: (rank, step) — a new process takes the rank,
    admitted at that step (it receives the average of the others)."""
    value = {r: float(r) for r in range(world)}
    live = set(range(world))
    traces = {f"rank{r}": [] for r in range(world)}
    gen = 1
    for s in range(steps):
        if replacement and s == replacement[1]:
            live.add(replacement[0])
            value[replacement[0]] = 0.0  # its own values go into nothing: it is joining
            gen += 1
            traces["replacement"] = []
        before = {r: value[r] + (r + 1) * (s + 1) * 0.5 for r in live}
        joining = {replacement[0]} if replacement and s == replacement[1] else set()
        after = dict(before)
        decided = {}
        for group in groups_at(s, live):
            contributors = [r for r in group if r not in joining]
            mean = sum(before[r] for r in contributors) / len(contributors)
            for r in group:
                after[r] = mean
                decided[r] = group
        for r in sorted(live):
            who = "replacement" if replacement and r == replacement[0] and s >= replacement[1] \
                else f"rank{r}"
            if killed and (r, s) == killed:
                continue  # died inside this call: prints nothing
            line = {"step": s, "rank": r, "value": after[r], "generation": gen,
                    "action": "AVERAGE" if r in decided else "SKIP",
                    "level": 0 if r in decided else -1,
                    "members": sorted(decided.get(r, [])),
                    "joining": sorted(joining & set(decided.get(r, [])))}
            if r in joining:
                line["admitted"] = True
            traces[who].append(line)
        value = after
        if killed and s == killed[1]:
            live.discard(killed[0])
            gen += 1
    return traces


def pairs_and_world(s, live):
    """Pairs (0,1), (2,3); every 3rd step all live ranks together; every 4th step (from 3)
    nobody averages."""
    if s % 4 == 3:
        return []
    if s % 3 == 0:
        return [sorted(live)]
    groups = [[r for r in (0, 1) if r in live], [r for r in (2, 3) if r in live]]
    return [g for g in groups if g]


class TraceRuleTest(unittest.TestCase):
    def strict(self):
        return simulate(4, 20, pairs_and_world)

    def elastic(self):
        # Rank 3 dies inside its call at step 6 (its peers completed that round with it), and a
        # replacement takes rank 3 at step 12.
        return simulate(4, 24, pairs_and_world, killed=(3, 6), replacement=(3, 12))

    def assert_fails(self, traces, says):
        violations, _ = trace_rule.check_all(traces)
        self.assertTrue(violations, f"the checker found nothing; expected: {says}")
        self.assertTrue(any(says in v for v in violations), f"{says!r} not in {violations}")
        with self.assertRaises(trace_rule.Violation):
            trace_rule.check(traces)

    def test_FollowingTheRule_Passes(self):
        for name, traces in (("strict", self.strict()), ("elastic", self.elastic())):
            violations, figures = trace_rule.check_all(traces)
            self.assertEqual(violations, [], name)
            self.assertGreater(figures["averages"], 40, name)
            self.assertGreater(figures["lines"], figures["averages"], name)
        self.assertEqual(trace_rule.check(self.strict()), 80)

    def test_AWrongAverage_Fails(self):
        t = self.elastic()
        line = next(x for x in t["rank1"] if x["action"] == "AVERAGE" and x["step"] == 9)
        line["value"] += 0.01
        self.assert_fails(t, "rank1: step 9 with members")

    def test_ANonFiniteValue_Fails(self):
        for bad in (math.nan, math.inf):
            t = self.strict()
            t["rank2"][7]["value"] = bad
            self.assert_fails(t, "not finite")

    def test_ASkipThatChangedTheValue_Fails(self):
        t = self.strict()
        line = next(x for x in t["rank0"] if x["action"] == "SKIP")
        line["value"] += 1
        self.assert_fails(t, "SKIP at step")

    def test_MembersThatDisagree_Fail(self):
        t = self.strict()
        t["rank0"][1]["members"] = [0, 1, 2]
        self.assert_fails(t, "but its member rank 2 printed")
        t = self.strict()
        t["rank0"][3]["members"] = [0, 1]  # a SKIP with members
        self.assert_fails(t, "SKIP with members")

    def test_AMemberThatNeitherPrintedNorDiedThere_Fails(self):
        t = self.strict()
        del t["rank2"][10:]  # rank 2 "died" in step 10's call ...
        t["rank3"] = [x for x in t["rank3"] if x["step"] != 12]  # ... rank 3 skipped a step
        violations, _ = trace_rule.check_all(t)
        self.assertTrue(any("step 12 expected" in v for v in violations), violations)
        # A member averaged with, whose process ended long before the step.
        t = self.strict()
        del t["rank2"][5:]
        self.assert_fails(t, "no process of rank 2 printed step 9")

    def test_TwoProcessesOfOneRankAtOneStep_Fail(self):
        t = self.elastic()
        t["impostor"] = copy.deepcopy(t["rank0"][:3])
        self.assert_fails(t, "both printed rank 0 at step 0")

    def test_AGenerationThatGoesDown_Fails(self):
        t = self.elastic()
        t["rank0"][15]["generation"] = 1
        self.assert_fails(t, "in generation 1 after generation")

    def test_AReplacementWithoutAdmission_Fails(self):
        t = self.elastic()
        del t["replacement"][0]["admitted"]
        self.assert_fails(t, "without an admitted line")

    def test_ALineCutShortByAKill_IsLeftOut(self):
        lines = trace_rule.parse('{"step": 0, "rank": 0}\n{"step": 1, "ra', "w")
        self.assertEqual(len(lines), 1)
        with self.assertRaises(trace_rule.Violation):
            trace_rule.parse('{"step": 0\n{"step": 1}\n', "w")


if __name__ == "__main__":
    unittest.main()
