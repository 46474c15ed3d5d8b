"""Scripted expert trajectories for the coding task families, written as SFT JSONL.

Before RL a small model has to know the tool format. For each task this
plays an expert through the real tools, on a real workspace: read the files
the task names (`CodingTask.reads`; all of them in one reply, as a list of
calls, since no read depends on another), apply the reference solution
(`write_file` for a whole file, `edit_file` for a search/replace), run the
tests (families with tests in the workspace), then `finish` with a short
message. Feature-deletion trajectories also keep a to-do list. Every
observation is what `tools.ToolSet` answered, so SFT shows the model exactly
the responses RL will give it, in the same system prompt (`agent.system_prompt`).
One JSONL line per task, for `pretrain_cpt.py --stage sft --data-path FILE`:

    python -m megatron_composer.rl.sft_trajectories --families write-file,set-constant \\
        --count 400 --split train --output runs/tiny/agent_sft/train.jsonl

A trajectory is checked as it is written: every call must run without error
or misuse and the tests must pass at the end, or generation stops with the
task's key (a broken reference solution, not a data point).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from ..data.tool_calls import MAX_CALLS_PER_MESSAGE, format_tool_call, format_tool_calls, parse_tool_calls
from ..data.sft import render_chat
from .agent import SUMMARY_HEADER, SUMMARY_PROMPT, system_prompt
from .agentic import test_report
from .sandbox import Sandbox
from .task_envs import sandbox_kwargs_for
from .tasks.coding import CodingTask, load_tasks, prepare_workspace, run_tests
from .tools import READ_ONLY_TOOLS, TOOLS, ToolSet

# families whose workspace holds the tests the model is asked to make pass
_RUNS_TESTS = ("set-constant", "fix-bug", "feature-deletion")
_KEEPS_TODO = ("feature-deletion",)


Step = list[tuple[str, dict]]  # the calls of one assistant message, in order
_RESPONSE = re.compile(r"<tool_response name=[^>]*>(.*?)</tool_response>", re.DOTALL)


def expert_steps(task: CodingTask) -> list[tuple[str, dict]]:
    """The expert's calls for `task`, in order, ending with finish (`expert_messages` groups them)."""
    edited = sorted({e.path for e in task.solution})
    steps: list[tuple[str, dict]] = []
    todo = [{"text": f"reimplement the removed code in {p}", "done": False} for p in edited]
    if task.family in _KEEPS_TODO:
        steps.append(("todo", {"items": todo}))
    steps += [("read_file", {"path": p}) for p in task.reads]
    for e in task.solution:
        steps.append(("write_file", {"path": e.path, "content": e.replace}) if e.search is None else
                     ("edit_file", {"path": e.path, "search": e.search, "replace": e.replace}))
    if task.family in _RUNS_TESTS:
        steps.append(("run_tests", {}))
    if task.family in _KEEPS_TODO:
        steps.append(("todo", {"items": [dict(t, done=True) for t in todo]}))
    if task.family == "write-file":
        message = f"Created {edited[0]}."
    else:
        message = f"Updated {', '.join(edited)}; the tests pass."
    steps.append(("finish", {"message": message}))
    return steps


def expert_messages(task: CodingTask, *, batch_reads: bool = True) -> list[Step]:
    """`expert_steps` as the expert's messages: consecutive reads share one message (in lists of
    at most MAX_CALLS_PER_MESSAGE), since no read depends on another; every other call is a
    message of its own, since what comes next depends on its result. `batch_reads=False`: one
    read per message too (the sequential habit `benchmarks/parallel_tools.py` starts from)."""
    messages: list[Step] = []
    for name, arguments in expert_steps(task):
        batch = (batch_reads and messages and name in READ_ONLY_TOOLS
                 and all(n in READ_ONLY_TOOLS for n, _ in messages[-1]))
        if batch and len(messages[-1]) < MAX_CALLS_PER_MESSAGE:
            messages[-1].append((name, arguments))
        else:
            messages.append([(name, arguments)])
    return messages


def step_text(step: Step) -> str:
    """What the assistant writes for one step: one call block, or one block with the list of calls."""
    return format_tool_call(*step[0]) if len(step) == 1 else format_tool_calls(step)


def expert_conversation(task: CodingTask, *, tool_names: Sequence[str] = tuple(TOOLS),
                        sandbox_kwargs: Optional[dict] = None, workdir: Optional[str] = None,
                        batch_reads: bool = True) -> list[dict]:
    """The chat messages of one scripted trajectory (system, user, then assistant / tool turns);
    `batch_reads`: as in `expert_messages`."""
    sandbox_kwargs = sandbox_kwargs_for(task, sandbox_kwargs)  # a task's own environment, if any
    messages = [{"role": "system", "content": system_prompt(tool_names)},
                {"role": "user", "content": task.instruction}]
    with tempfile.TemporaryDirectory(prefix="expert-", dir=workdir) as tmp:
        workspace = Path(tmp) / "workspace"
        prepare_workspace(task, workspace)
        tools = ToolSet(workspace, Sandbox(workspace, **sandbox_kwargs), names=tool_names,
                        run_tests=lambda: test_report(run_tests(task, workspace, sandbox_kwargs=sandbox_kwargs)))
        for step in expert_messages(task, batch_reads=batch_reads):
            text = step_text(step)
            messages.append({"role": "assistant", "content": text})
            turn = tools.respond(text)
            bad = [e for e in turn.events if e.misuse or not e.ok]
            if bad:
                raise RuntimeError(f"the expert trajectory of {task.key} failed at {bad[0].name}: "
                                   f"{bad[0].error or bad[0].misuse}")
            if turn.finished:
                break
            messages.append({"role": "user", "content": turn.observation})
        verdict = run_tests(task, workspace, sandbox_kwargs=sandbox_kwargs)
    if not verdict.all_pass:
        raise RuntimeError(f"the reference solution of {task.key} does not pass its tests: "
                           f"{verdict.passed}/{verdict.total}\n{verdict.output[-800:]}")
    return messages


def summary_text(task: CodingTask, messages: Sequence[dict]) -> str:
    """The expert's summary of the work so far (`agent.SUMMARY_PROMPT` asks for it): what each read
    file held (its first line, cut at 40 characters), the files left to read and the files written.
    Written for the read-then-edit families, whose state is what was read and written."""
    read: dict[str, str] = {}
    written: list[str] = []
    for call, answer in zip(messages, messages[1:]):
        if call["role"] != "assistant" or answer["role"] != "user":
            continue
        calls = parse_tool_calls(call["content"])[1]
        bodies = _RESPONSE.findall(answer["content"])  # one response per call, in call order
        for c, body in zip(calls, bodies):
            if c.name in ("write_file", "edit_file") and c.arguments["path"] not in written:
                written.append(c.arguments["path"])
            if c.name != "read_file":
                continue
            path = c.arguments["path"]
            read[path] = (body.strip().splitlines() or [""])[0][:40]
    done = "; ".join(f"{path} holds {text}" for path, text in read.items()) or "nothing yet"
    left = [p for p in task.reads if p not in read]
    return (f"Read: {done}." + (f" Left to read: {', '.join(left)}." if left else " Every file is read.")
            + (f" Wrote {', '.join(written)}." if written else ""))


def summarized_segments(task: CodingTask, messages: list[dict], tokenizer, trigger_tokens: int) -> list[list[dict]]:
    """`messages` (an `expert_conversation`) cut into the segments the agent loop makes with
    `--summary-trigger-tokens trigger_tokens` (`agent.Agent.run`): before a model turn, once the
    segment's context holds at least `trigger_tokens` tokens, the segment ends with
    `SUMMARY_PROMPT` and the expert's `summary_text`, and the next one starts from the system
    prompt and the task followed by `SUMMARY_HEADER` and the summary. One SFT conversation per
    segment (the summary is trained, as in RL)."""
    system, task_turn, rest = messages[0], messages[1], messages[2:]
    segments, segment, summaries = [], [system, task_turn], []
    for i in range(0, len(rest), 2):
        length = len(render_chat(segment, tokenizer, add_generation_prompt=True)[0])
        if length >= trigger_tokens and len(segment) > 2:
            summary = summary_text(task, [m for s in [*segments, segment] for m in s[2:]
                                          if m["content"] != SUMMARY_PROMPT])
            segments.append([*segment, {"role": "user", "content": SUMMARY_PROMPT},
                             {"role": "assistant", "content": summary}])
            summaries.append(summary)
            segment = [system, {"role": "user", "content": f"{task_turn['content']}\n\n{SUMMARY_HEADER}{summary}"}]
        segment += rest[i:i + 2]
    return [*segments, segment]


def sequential_reader(task: CodingTask, fraction: float) -> bool:
    """Whether `task`'s trajectory reads one file per message, for about `fraction` of the tasks
    (by the hash of its key: the same tasks on every machine and at every count)."""
    return int(hashlib.sha1(f"sequential/{task.key}".encode()).hexdigest()[:8], 16) < fraction * 16 ** 8


def write_sft_jsonl(path, tasks: Sequence[CodingTask], *, workers: int = 4, log=print,
                    sequential_reads: float = 0.0, summarize: Optional[tuple] = None, **kwargs) -> int:
    """Write one conversation per task to `path` (atomically: a temp file renamed at the end);
    about `sequential_reads` of them read one file per message (`sequential_reader`).
    `summarize=(tokenizer, trigger_tokens)`: each conversation is cut into the segments of
    self-summarization (`summarized_segments`), one line per segment ("segment": its index)."""
    if not 0.0 <= sequential_reads <= 1.0:
        raise ValueError(f"sequential_reads={sequential_reads} is a fraction of the tasks; give one in [0, 1]")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    started, done = time.perf_counter(), 0
    with open(tmp, "w", encoding="utf-8") as out, concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for task, messages in zip(tasks, pool.map(lambda t: expert_conversation(
                t, batch_reads=not sequential_reader(t, sequential_reads), **kwargs), tasks)):
            if summarize is None:
                out.write(json.dumps({"messages": messages, "task": task.key}, ensure_ascii=False) + "\n")
            else:
                for j, segment in enumerate(summarized_segments(task, messages, *summarize)):
                    out.write(json.dumps({"messages": segment, "task": task.key, "segment": j},
                                         ensure_ascii=False) + "\n")
            done += 1
            if log and (done % 100 == 0 or done == len(tasks)):
                log(f"  {done}/{len(tasks)} trajectories ({time.perf_counter() - started:.1f} s)")
    os.replace(tmp, path)
    return done


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_composer.rl.sft_trajectories",
                                description="Scripted expert trajectories of the coding task families, as SFT JSONL.")
    p.add_argument("--families", default="write-file", help="comma list of task families")
    p.add_argument("--count", type=int, default=None, help="tasks per family (default: all of the split)")
    p.add_argument("--split", choices=("train", "eval"), default="train")
    p.add_argument("--output", required=True, help="the JSONL file to write")
    p.add_argument("--workers", type=int, default=4, help="trajectories built at once")
    p.add_argument("--summary-trigger-tokens", type=int, default=None, metavar="N",
                   help="cut each trajectory into self-summarization segments as the agent loop does at "
                        "--summary-trigger-tokens N (one line per segment; the expert writes the summary)")
    p.add_argument("--tokenizer-model", default=None,
                   help="the tokenizer that counts the segments' tokens (with --summary-trigger-tokens)")
    p.add_argument("--sequential-reads", type=float, default=0.0, metavar="FRACTION",
                   help="this fraction of the trajectories reads one file per message instead of all "
                        "independent reads in one list of calls (default 0: always batched)")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if args.summary_trigger_tokens is not None and (args.summary_trigger_tokens < 1 or not args.tokenizer_model):
        p.error("--summary-trigger-tokens N needs N >= 1 and --tokenizer-model (the tokens are counted with it)")
    try:
        summarize = None
        if args.summary_trigger_tokens is not None:
            from ..data.tokenizer import Tokenizer

            summarize = (Tokenizer(args.tokenizer_model), args.summary_trigger_tokens)
        tasks = [t for family in families for t in load_tasks([family], args.split, count=args.count)]
        print(f"> {len(tasks)} {args.split} tasks of {', '.join(families)} -> {args.output}")
        write_sft_jsonl(args.output, tasks, workers=args.workers, sequential_reads=args.sequential_reads,
                        summarize=summarize)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
