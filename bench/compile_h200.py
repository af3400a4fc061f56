"""Compile every Pallas kernel for an NVIDIA H200 on a machine with no GPU, and report
what ptxas says of each: registers, spills, shared memory.

    make compile-h200                  # .venv-h200, heuristic configs and switched variants
    .venv-h200/bin/python bench/compile_h200.py --out results/compile-h200 [--space] [--jobs N]
        [--only ragged_dot,attention]

Why: the GPU machine is lent rarely and for minutes. Everything between a kernel and the
H200 except the card itself runs here: XLA's GPU compiler (the CUDA PJRT plugin) compiles a
whole program for a topology described by `h200_target_config.txtpb` (deviceless AOT), and
runs Triton and ptxas for `sm_90a` on the Pallas Triton kernels; Mosaic GPU kernels are
compiled by the plugin's `MosaicGpuCompile` (Mosaic GPU passes, LLVM NVPTX, ptxas). A kernel
that fails there would fail on the GPU; one that spills registers to local memory would be
slow there. Mosaic GPU's compile asks the CUDA driver which GPU it compiles for, so a stand-in
`libcuda.so.1` (built here with gcc from the plugin's own list of driver entry points) answers
"one compute capability 9.0 device" and refuses to load modules: nothing is run.

For each workload of `bench/gpu_check.py` (the speed-target shapes) and each Pallas
implementation, the op calls of the forward (and gradient) program are captured, and each
call's heuristic config is compiled alone, with, for each value of a bool or str tunable
(a switch of code path, e.g. attention's fused dQ), the config of the space nearest the
heuristic that takes it (`search.code_path_variants`; with --space: every config of its
search space).
A kernel that spills is disassembled (ptxas again, then nvdisasm) to see whether any
spill instruction lies inside a loop, where it costs every iteration; spills all outside
loops (set-up, between loops) are shown but not counted as slow. Each kernel's row also
says what its PTX shows (a ptxas wrapper keeps the PTX XLA compiles): its tensor-core
instruction (wgmma, the warp-level mma.sync, or none), how it copies operands to shared
memory (TMA, cp.async, or not asynchronously), its widest global load, and whether some
path of its control flow reads shared memory through the async proxy (wgmma operands, a
TMA store) after an ordinary store with no proxy fence in between (`commit_smem`): data
the GPU may read stale and interpret mode, which has no proxies, cannot show wrong
(`ptx_unfenced_async_reads`). Compile-only workloads (`more_workloads`) add attention's
other head dims and float16, and sizes no tile divides. Writes `<out>/kernels.json` (a
row per compiled kernel, XLA's own fusions included) and prints the Pallas kernels'
rows, grouped by workload, last. Exits 1 when a config fails to compile or reads shared
memory unfenced, or when a heuristic config is slow at a speed target: it spills
registers inside a loop, has its wgmma serialized, multiplies without asynchronous
copies (nothing overlaps its loads), or streams memory without 16-byte loads; and
when a heuristic config serializes its wgmma anywhere (what every user gets untuned,
and the tensor cores then overlap nothing). (mma.sync
is shown, not failed on: Triton takes it for tiles under 64 rows.)

Needs (the `compile-h200` make target installs them, requirements/h200-compile.txt):
jax-cuda13-plugin and -pjrt of the pinned jax version, ptxas and libdevice from
nvidia-cuda-nvcc (else a ptxas on PATH), nvdisasm from nvidia-cuda-nvdisasm (without it
spills are not located, so all count as slow), and gcc.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

HERE = Path(__file__).resolve().parent
TARGET_CONFIG = HERE / "h200_target_config.txtpb"

# ----------------------------------------------------------------------------- ptxas output


class _SpilledBytes:
  """`spills` of a record with spill_stores and spill_loads (bytes a thread)."""

  @property
  def spills(self) -> bool:
    return bool(self.spill_stores or self.spill_loads)


@dataclasses.dataclass
class KernelStats(_SpilledBytes):
  """What ptxas reported for one entry function (and, where known, its launch)."""
  name: str
  registers: int | None = None
  spill_stores: int = 0  # bytes
  spill_loads: int = 0  # bytes
  stack_frame: int = 0  # bytes
  barriers: int | None = None
  shared_memory: int | None = None  # bytes, dynamic (what the kernel asks at launch)
  threads: int | None = None
  grid: tuple[int, ...] | None = None
  # The tensor-core instruction of the kernel's PTX: "wgmma" (Hopper's asynchronous
  # warpgroup MMA, what peak speed needs), "mma" (the older warp-level mma.sync), or
  # "none"; None where the PTX was not seen.
  tensor_cores: str | None = None
  # How operands reach shared memory: "tma" (cp.async.bulk, Hopper's tensor memory
  # accelerator), "cp.async" (Ampere's asynchronous copies: what Triton pipelines
  # num_stages deep), or "none" (loads through registers: a matmul then waits for each
  # tile); None where the PTX was not seen.
  async_copies: str | None = None
  # The widest global load of the PTX in bits (128: 16-byte vector loads, what a
  # memory-bound kernel needs for full bandwidth; 0: none, e.g. only TMA).
  global_load_bits: int | None = None
  # Reads of shared memory by wgmma or a TMA store that may follow an ordinary store
  # with no proxy fence between (see ptx_unfenced_async_reads): wrong data on the GPU,
  # invisible in interpret mode. None where the PTX was not seen.
  unfenced_async_reads: int | None = None
  pallas: bool = False  # a Pallas (Triton or Mosaic GPU) kernel, not one of XLA's own
  # Spill instructions (local stores and loads ptxas marks as spill refills) inside the
  # loops that do the kernel's steps, where every step pays them; 0 when every spill
  # lies outside them (set up, between loops, the epilogue: a few accesses per kernel,
  # or once per tile of a persistent kernel: spills_in_outer_loops). None where not
  # disassembled (no spills, or no nvdisasm). See sass_spill_sites.
  spills_in_loops: int | None = None
  spills_in_outer_loops: int | None = None
  # ptxas's numbered performance remarks, e.g. "C7515 Potential Performance Loss:
  # wgmma.mma_async instructions are serialized due to ..." (C7510 to C7515 name the
  # causes: the tensor cores' pipeline is lost) or "C7519 warpgroup.arrive is injected
  # ..." (a fence ptxas added before a wgmma that reads registers).
  remarks: list[str] = dataclasses.field(default_factory=list)

  @property
  def wgmma_serialized(self) -> bool:
    return any("wgmma.mma_async instructions are serialized" in r for r in self.remarks)

  def apply(self, traits: "PtxTraits | None") -> None:
    """Takes the facts read from the kernel's PTX (see ptx_traits)."""
    if traits is not None:
      self.tensor_cores = traits.tensor_cores
      self.async_copies = traits.async_copies
      self.global_load_bits = traits.global_load_bits
      self.unfenced_async_reads = traits.unfenced_async_reads


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPERTIES = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
_REMARK = re.compile(r"ptxas (?:info|warning)\s*: \((C\d+)\) (.*?)(?: in (?:the )?function '([^']+)')?\.?$")


def parse_ptxas(text: str) -> dict[str, KernelStats]:
  """Per entry function, what `ptxas -v` printed in `text` (other lines are ignored).

  Args:
    text: ptxas's verbose output, possibly interleaved with unrelated log lines.

  Returns:
    {entry function name: KernelStats}, in the order ptxas compiled them.
  """
  out: dict[str, KernelStats] = {}
  current: KernelStats | None = None
  remarks: list[tuple[str | None, str]] = []
  for line in text.splitlines():
    if m := _REMARK.search(line):
      remarks.append((m.group(3), f"{m.group(1)} {m.group(2)}"))
    elif m := _ENTRY.search(line):
      current = out.setdefault(m.group(1), KernelStats(m.group(1)))
    elif current is not None and (m := _PROPERTIES.search(line)):
      current.stack_frame, current.spill_stores, current.spill_loads = map(int, m.groups())
    elif current is not None and (m := _USED.search(line)):
      current.registers = int(m.group(1))
      current.barriers = int(m.group(2)) if m.group(2) else 0
  # ptxas prints remarks before the function's report; one naming no function belongs to
  # the only kernel, if there is one.
  for function, remark in remarks:
    target = out.get(function) if function else (next(iter(out.values())) if len(out) == 1 else None)
    if target is not None:
      target.remarks.append(remark)
  return out


_THUNK = re.compile(r"kCustomKernel\b.*?\s(\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")


def parse_thunk_sequence(text: str) -> dict[str, tuple[tuple[int, ...], int, int]]:
  """The kernel launches of XLA's thunk sequence dump (its own fusions and Pallas's
  kernels alike): {name: (grid, threads, shared memory bytes)}."""
  out = {}
  for m in _THUNK.finditer(text):
    grid = tuple(int(x) for x in m.group(2).split(","))
    threads = 1
    for x in m.group(3).split(","):
      threads *= int(x)
    out[m.group(1)] = (grid, threads, int(m.group(4)))
  return out


_SMEM_SCRATCH = re.compile(r"smem_scratch_bytes=(\d+)")
_PTX_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+(\w+)", re.M)


@dataclasses.dataclass(frozen=True)
class PtxTraits:
  """What an entry function's PTX shows of its speed (see the KernelStats fields)."""
  tensor_cores: str  # "wgmma", "mma" or "none"
  async_copies: str  # "tma", "cp.async" or "none"
  global_load_bits: int  # the widest ld.global, in bits (0: none)
  unfenced_async_reads: int = 0  # see ptx_unfenced_async_reads


_GLOBAL_LOAD = re.compile(r"\bld\.global(?:\.\w+)*?(?:\.v(\d))?\.[bfsu](\d+)\b")


def ptx_traits(ptx: str) -> dict[str, PtxTraits]:
  """Per entry function of a PTX module, its tensor-core instruction, how it copies
  operands to shared memory, and its widest global load (see KernelStats)."""
  starts = [(m.start(), m.group(1)) for m in _PTX_ENTRY.finditer(ptx)] + [(len(ptx), None)]
  out = {}
  for (begin, name), (end, _) in zip(starts, starts[1:]):
    body = ptx[begin:end]
    loads = [int(v or 1) * int(bits) for v, bits in _GLOBAL_LOAD.findall(body)]
    out[name] = PtxTraits(
        tensor_cores=("wgmma" if "wgmma.mma_async" in body
                      else "mma" if re.search(r"\bmma\.sync", body) else "none"),
        async_copies=("tma" if "cp.async.bulk" in body
                      else "cp.async" if re.search(r"\bcp\.async\.c[ag]\b", body) else "none"),
        global_load_bits=max(loads, default=0),
        unfenced_async_reads=ptx_unfenced_async_reads(body))
  return out


# Shared memory written through the generic proxy (ordinary stores, stmatrix, and
# Ampere's cp.async, which Triton's pipelines feed wgmma with), the fence that makes
# such writes visible to the async proxy, and what reads shared memory through the
# async proxy: wgmma's operand descriptors and TMA stores (global <- shared).
_PTX_SMEM_STORE = re.compile(r"\b(?:st\.shared|stmatrix|cp\.async\.c[ag]\.shared)\b")
_PTX_PROXY_FENCE = re.compile(r"\bfence\.proxy\.async\b")
_PTX_ASYNC_READ = re.compile(
    r"\bwgmma\.mma_async\b|\bcp(?:\.reduce)?\.async\.bulk(?:\.tensor)?(?:\.\w+)*?\.global\.shared")
_PTX_LABEL = re.compile(r"^\s*(\$?\w+):\s*$")
_PTX_BRANCH = re.compile(r"^\s*(?P<pred>@!?%?\w+\s+)?bra(?:\.uni)?\s+(?P<target>\$?\w+)\s*;")
_PTX_END = re.compile(r"^\s*(?P<pred>@!?%?\w+\s+)?(?:ret|exit|trap)\s*;")


def _ptx_instructions(body: str) -> tuple[list[str], dict[str, int]]:
  """A PTX function body as (instructions, label -> index of the instruction it names).
  An inline-asm block in braces is one instruction (its own labels stay inside it)."""
  instrs: list[str] = []
  labels: dict[str, int] = {}
  block: list[str] | None = None
  depth = 0
  lines = [line.split("//", 1)[0].rstrip() for line in body.splitlines()]
  # The function's own braces: its first line of "{" and its last of "}".
  braces = [i for i, line in enumerate(lines) if line.strip() in ("{", "}")]
  if braces:
    lines = lines[braces[0] + 1:max(i for i in braces if lines[i].strip() == "}")]
  for line in lines:
    if not line.strip():
      continue
    opens, closes = line.count("{"), line.count("}")
    if block is not None or opens:
      block = [] if block is None else block
      block.append(line.strip())
      depth += opens - closes
      if depth <= 0:
        instrs.append(" ".join(block))
        block, depth = None, 0
      continue
    label = _PTX_LABEL.match(line)
    if label:
      labels[label.group(1)] = len(instrs)
    else:
      instrs.append(line.strip())
  return instrs, labels


def ptx_unfenced_async_reads(body: str) -> int:
  """Async-proxy reads of shared memory that may follow a generic-proxy write without a
  `fence.proxy.async` in between, on some path of one thread's control flow.

  wgmma reads its shared-memory operands, and a TMA store its source, through the async
  proxy; a value stored to shared memory with an ordinary store (or stmatrix, or
  copied there by cp.async) is visible to them only after a proxy fence
  (`plgpu.commit_smem()` in Pallas; Triton places its own). Without one the GPU may
  read stale data, and nothing in interpret mode shows it (it has no proxies). A
  forward may-analysis over the function's control-flow graph: a store makes the
  state dirty, a fence clean; an async read reached dirty is counted. It sees one
  thread's own writes (a write in one warpgroup, fenced or not, read by
  another after a barrier is not judged).

  Args:
    body: the PTX of one function (from its `.entry` line to the next).

  Returns:
    The number of async-read instructions some path reaches with an unfenced write.
  """
  instrs, labels = _ptx_instructions(body)
  block_of, succ, _ = _basic_blocks(instrs, labels, _PTX_BRANCH, _PTX_END)
  members: list[list[int]] = [[] for _ in succ]  # each block's instructions, in order
  for i, b in block_of.items():
    members[b].append(i)
  dirty_in = [False] * len(succ)
  flagged: set[int] = set()
  work = list(range(len(succ)))
  while work:
    b = work.pop()
    dirty = dirty_in[b]
    for i in members[b]:
      ins = instrs[i]
      if _PTX_ASYNC_READ.search(ins) and dirty:
        flagged.add(i)
      if _PTX_PROXY_FENCE.search(ins):
        dirty = False
      elif _PTX_SMEM_STORE.search(ins):
        dirty = True
    for t in succ[b]:
      if dirty and not dirty_in[t]:
        dirty_in[t] = True
        work.append(t)
  return len(flagged)


_SASS_LINE = re.compile(
    r"^\s*(?:\.(?P<label>L_x_\d+):|/\*(?P<addr>[0-9a-f]+)\*/\s+(?P<instr>.*?);)")
_SASS_BRANCH = re.compile(r"^(?P<pred>@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+`\(\.(?P<target>L_x_\d+)\)")
_SASS_EXIT = re.compile(r"^(?P<pred>@!?U?P\w+\s+)?EXIT\b")
_SASS_SPILL = re.compile(r"^(?:@!?P\w+\s+)?(?:STL|LDL)\b")
# What a pipeline step does: tensor-core products (compute warpgroups) or TMA loads
# (a memory warpgroup's loop).
_SASS_STEP = re.compile(r"\bHG?MMA\b|\bUTMALDG\b")
_SASS_WAIT = re.compile(r"\bSYNCS\.PHASECHK\b")
# What an mbarrier wait's retry loop holds: the wait, a sleep, the branch, and moves or
# spill reloads of the barrier's address.
_SASS_SPIN = re.compile(
    r"^(?:@!?U?P\w+\s+)?(?:SYNCS\.PHASECHK|NANOSLEEP|BRA|R2UR|IMAD\.(?:U32|MOV)|U?MOV|LDL)\b")


@dataclasses.dataclass(frozen=True)
class SpillSites:
  """Where a function's spill instructions are (see sass_spill_sites).

  Attributes:
    in_loops: inside loops that do the kernel's steps (every iteration pays them).
    in_outer_loops: inside a loop only around such a loop (e.g. a persistent kernel's
      tile loop around its contraction loop): once per outer iteration.
    total: all spill instructions.
  """

  in_loops: int
  in_outer_loops: int
  total: int


def sass_spill_sites(sass: str) -> SpillSites:
  """Where the spills of one function's SASS (`nvdisasm -c` output) are.

  Spills are the local stores and loads ptxas marks `"SpillRefill"`. Loops are natural
  loops of the control-flow graph (a branch back to a block that dominates it; loops
  with one head are one loop). The out-of-line retry blocks of mbarrier waits at a
  function's end branch back into the body, but not to a block dominating them, so
  they do not make the body a loop; a retry block that branches to itself is a spin
  loop (an mbarrier wait and nothing but moves and reloads of its address), whose
  spills run only while the wait does and count as the loops around it. A spill is in
  an outer loop when the smallest loop around it holds a step loop (tensor-core
  products, HGMMA or HMMA, or a memory warpgroup's TMA loads, UTMALDG) that does not
  hold the spill: it runs once per outer iteration, not once a step. Kernels without
  step loops count every spill in a loop as a step's.

  Args:
    sass: one function's disassembly (see `sass_functions`).

  Returns:
    The counts of spill instructions in step loops, in outer loops only, and in all.
  """
  instrs, block_of, succ, pred = _sass_cfg(sass)
  blocks_with = lambda pattern: {block_of[i] for i, ins in enumerate(instrs)
                                 if pattern.search(ins)}
  step_blocks, wait_blocks = blocks_with(_SASS_STEP), blocks_with(_SASS_WAIT)
  busy_blocks = {block_of[i] for i, ins in enumerate(instrs) if not _SASS_SPIN.match(ins)}
  loops = [body for body in _natural_loops(succ, pred)
           if not (body & wait_blocks and not body & busy_blocks)]  # (not spin loops)
  step_loops = [body for body in loops if body & step_blocks]
  in_loops = in_outer = 0
  spills = [i for i, ins in enumerate(instrs) if _SASS_SPILL.match(ins) and "SpillRefill" in ins]
  for i in spills:
    around = [body for body in loops if block_of[i] in body]
    if not around:
      continue
    # (A step loop inside the smallest loop around the spill cannot hold it.)
    smallest = min(around, key=len)
    if any(inner < smallest for inner in step_loops):
      in_outer += 1
    else:
      in_loops += 1
  return SpillSites(in_loops, in_outer, len(spills))


def _sass_cfg(sass: str) -> tuple[list[str], dict[int, int], list[set[int]], list[set[int]]]:
  """The control-flow graph of one function's SASS: (instructions in address order,
  instruction -> its basic block, each block's successors, each block's predecessors)
  (see `_basic_blocks`)."""
  instrs: list[str] = []
  labels: dict[str, int] = {}  # label -> index of the instruction it names
  for line in sass.splitlines():
    m = _SASS_LINE.match(line)
    if m and m.group("label"):
      labels[m.group("label")] = len(instrs)
    elif m:
      instrs.append(m.group("instr").strip())
  return (instrs, *_basic_blocks(instrs, labels, _SASS_BRANCH, _SASS_EXIT))


def _basic_blocks(instrs: list[str], labels: dict[str, int], branch: re.Pattern,
                  end: re.Pattern) -> tuple[dict[int, int], list[set[int]], list[set[int]]]:
  """The basic blocks of one function (SASS or PTX): (instruction -> its block, each
  block's successors, each block's predecessors). Leaders are the first instruction,
  branch targets and what follows a branch or an end; a block falls through to the
  next unless it ends in an unpredicated branch or end.

  Args:
    instrs: the instructions in order.
    labels: label -> index of the instruction it names.
    branch: matches a branch instruction, with groups "pred" (its predicate, if any)
      and "target" (a label).
    end: matches an instruction that ends the thread (exit, return), with group "pred".
  """
  if not instrs:
    return {}, [], []
  leaders = {0, *labels.values()}
  for i, ins in enumerate(instrs):
    if branch.match(ins) or end.match(ins):
      leaders.add(i + 1)
  starts = sorted(x for x in leaders if x < len(instrs))
  block_of = {}
  for b, (lo, hi) in enumerate(zip(starts, [*starts[1:], len(instrs)])):
    for i in range(lo, hi):
      block_of[i] = b
  succ: list[set[int]] = []
  always = lambda m: m is not None and not m.group("pred")  # unconditional
  for b, last in enumerate(hi - 1 for hi in [*starts[1:], len(instrs)]):
    jump, stop = branch.match(instrs[last]), end.match(instrs[last])
    out = set()
    if jump and labels.get(jump.group("target"), -1) in block_of:
      out.add(block_of[labels[jump.group("target")]])
    if not (always(jump) or always(stop)) and b + 1 < len(starts):
      out.add(b + 1)
    succ.append(out)
  pred: list[set[int]] = [set() for _ in starts]
  for b, out in enumerate(succ):
    for t in out:
      pred[t].add(b)
  return block_of, succ, pred


def _natural_loops(succ: list[set[int]], pred: list[set[int]]) -> list[set[int]]:
  """The natural loops of a control-flow graph whose entry is block 0, one body per
  loop head: a back edge (tail -> head, head dominating tail) makes head, tail and
  every block that reaches tail without passing head a loop."""
  if not succ:
    return []
  # Dominators, by the iterative data-flow method.
  everything = set(range(len(succ)))
  dom = [everything.copy() for _ in succ]
  dom[0] = {0}
  changed = True
  while changed:
    changed = False
    for b in range(1, len(succ)):
      new = {b} | (set.intersection(*(dom[p] for p in pred[b])) if pred[b] else set())
      if new != dom[b]:
        dom[b], changed = new, True
  loops: dict[int, set[int]] = {}  # head -> body
  for tail, out in enumerate(succ):
    for head in out:
      if head in dom[tail]:
        body, stack = loops.setdefault(head, {head}), []
        if tail not in body:  # (a block branching to itself is its own loop)
          body.add(tail)
          stack.append(tail)
        while stack:
          for p in pred[stack.pop()]:
            if p not in body:
              body.add(p)
              stack.append(p)
  return list(loops.values())


def sass_functions(disassembly: str) -> dict[str, str]:
  """`nvdisasm -c` output of a module, split per function: {name: its SASS}."""
  parts = re.split(r"^//-+ \.text\.(\S+) -+\s*$", disassembly, flags=re.M)
  return {name: body for name, body in zip(parts[1::2], parts[2::2])}


def _printed_ptx(printed: str) -> str:
  """The PTX module in Mosaic GPU's printed dump (MOSAIC_GPU_DUMP_PTX), without the
  ptxas report that follows it."""
  start = printed.find("//\n// Generated by LLVM NVPTX")
  if start < 0:
    return ""
  end = printed.find("\nptxas ", start)
  return printed[start:] if end < 0 else printed[start:end + 1]


def _cuda_tool(name: str) -> str | None:
  """A CUDA binary next to the ptxas that compiles here (nvidia-cuda-* wheels install
  into one bin folder), else on PATH."""
  try:
    beside = _ptxas_dir() / name
  except SystemExit:
    beside = None
  if beside is not None and beside.exists():
    return str(beside)
  return shutil.which(name)


def locate_spills(k: KernelStats, ptx: str, work: Path) -> None:
  """Sets k.spills_in_loops and k.spills_in_outer_loops from the SASS of its PTX module
  (ptxas for sm_90a, then nvdisasm); leaves them None without nvdisasm, or when this
  recompile does not spill."""
  nvdisasm, ptxas = _cuda_tool("nvdisasm"), _cuda_tool("ptxas")
  if not (nvdisasm and ptxas and ptx):
    return
  folder = Path(tempfile.mkdtemp(dir=work))
  try:
    (folder / "m.ptx").write_text(ptx)
    compiled = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", str(folder / "m.cubin"),
                               str(folder / "m.ptx")], capture_output=True, text=True)
    again = parse_ptxas(compiled.stdout + compiled.stderr).get(k.name)
    # ptxas's spills vary a little from run to run (a few bytes); a recompile that does
    # not spill at all says nothing of where the real compile's spills are.
    if compiled.returncode or again is None or not again.spills:
      return
    sass = subprocess.run([nvdisasm, "-c", str(folder / "m.cubin")], capture_output=True,
                          text=True).stdout
    function = sass_functions(sass).get(k.name)
    if function is not None:
      sites = sass_spill_sites(function)
      k.spills_in_loops, k.spills_in_outer_loops = sites.in_loops, sites.in_outer_loops
  finally:
    shutil.rmtree(folder, ignore_errors=True)


# Installed as `ptxas` ahead of the real one on PATH: keeps a copy of each PTX module XLA
# compiles (XLA passes it as a temporary file and deletes it).
_PTXAS_WRAPPER = """#!/bin/sh
skip=0
for arg in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$arg" in
    -o) skip=1 ;;
    -*) ;;
    *) cp "$arg" "{keep}/$$.$(date +%s%N).ptx" 2>/dev/null; break ;;
  esac
done
exec "{real}" "$@"
"""

# ----------------------------------------------------------------------------- environment


def _plugin_library() -> Path:
  spec = importlib.util.find_spec("jax_plugins.xla_cuda13")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("compile_h200 needs the CUDA PJRT plugin: pip install -r requirements/h200-compile.txt"
                     " (or run `make compile-h200`).")
  return Path(list(spec.submodule_search_locations)[0]) / "xla_cuda_plugin.so"


# Driver calls whose answers the compile path reads; every other entry point succeeds and
# writes nothing. Module loads fail, so nothing compiled here can be launched.
_SHIM_SPECIAL = r"""
#include <stdio.h>
#include <string.h>
enum { kMajor = 75, kMinor = 76, kSms = 16, kSmemOptin = 97, kSmemPerBlock = 8 };
int cuDeviceGetAttribute(int* v, int attr, int dev) {
  switch (attr) {
    case kMajor: *v = 9; break;
    case kMinor: *v = 0; break;
    case kSms: *v = 132; break;
    case kSmemOptin: *v = 232448; break;
    case kSmemPerBlock: *v = 49152; break;
    default: *v = 1;
  }
  return 0;
}
int cuCtxGetDevice(int* d) { *d = 0; return 0; }
int cuDeviceGet(int* d, int ordinal) { *d = 0; return 0; }
int cuDeviceGetCount(int* c) { *c = 1; return 0; }
int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
int cuDeviceComputeCapability(int* major, int* minor, int d) { *major = 9; *minor = 0; return 0; }
int cuDeviceGetName(char* n, int len, int d) { strncpy(n, "NVIDIA H200", len); return 0; }
static int refuse(void) { fprintf(stderr, "[compile_h200] no GPU: module not loaded\n"); return 200; }
int cuModuleLoadData(void** m, const void* image) { return refuse(); }
int cuModuleLoadDataEx(void** m, const void* image, unsigned n, void* o, void** v) { return refuse(); }
int cuLibraryLoadData(void** l, const void* image, void* a, void* b, unsigned n, void* c, void* d, unsigned e) { return refuse(); }
// What the refusals mean, for the plugin's error messages (from jax 0.12.1 on Mosaic GPU's
// compile formats one after the refused load, and read a string from a pointer never set).
int cuGetErrorString(int e, const char** s) { *s = "no GPU here (compile_h200's stand-in driver)"; return 0; }
int cuGetErrorName(int e, const char** s) { *s = "CUDA_ERROR_NO_DEVICE"; return 0; }
int cuGetProcAddress(const char* s, void** p, int v, unsigned long long f, int* st) { *p = 0; if (st) *st = 1; return 500; }
int cuGetProcAddress_v2(const char* s, void** p, int v, unsigned long long f, int* st) { *p = 0; if (st) *st = 1; return 500; }
"""


def build_driver_stand_in(plugin: Path, cache: Path) -> Path:
  """Builds (once per plugin) the stand-in `libcuda.so.1` described in the module docstring.

  Returns:
    The shared library's path.

  Raises:
    SystemExit: when gcc is missing or fails.
  """
  data = plugin.read_bytes()
  names = sorted(set(n.decode() for n in re.findall(rb"\x00(cu[A-Z][A-Za-z0-9_]+)\x00", data)))
  special = set(re.findall(r"^int (cu\w+)\(", _SHIM_SPECIAL, flags=re.M))
  source = _SHIM_SPECIAL + "".join(f"int {n}(void) {{ return 0; }}\n" for n in names if n not in special)
  out = cache / f"libcuda-stand-in-{hashlib.sha256(source.encode()).hexdigest()[:16]}.so"
  if not out.exists():
    cache.mkdir(parents=True, exist_ok=True)
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
      raise SystemExit("compile_h200 builds a stand-in libcuda.so.1 with gcc; install gcc.")
    # Built under a name of this process's own and renamed into place: workers of a
    # parallel run (--jobs) may build it at the same time, and none may load a half-written one.
    src = out.with_name(f"{out.stem}.{os.getpid()}.c")
    partial = src.with_suffix(".so")
    src.write_text(source)
    subprocess.run([gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(partial),
                    str(src)], check=True)
    os.replace(partial, out)
    src.unlink()
  return out


def _ptxas_dir() -> Path:
  """The CUDA bin folder whose ptxas compiles here: nvidia-cuda-nvcc's (pinned with the
  plugin), else the first on PATH."""
  spec = importlib.util.find_spec("nvidia")
  for root in (spec.submodule_search_locations if spec else []):
    for candidate in sorted(Path(root).glob("cu*/bin/ptxas")):
      return candidate.parent
  found = shutil.which("ptxas")
  if found:
    return Path(found).resolve().parent
  raise SystemExit("compile_h200 needs ptxas (CUDA 13): pip install -r requirements/h200-compile.txt.")


def _cuda_root_keeping_ptx(real: Path, work: Path) -> Path:
  """A CUDA folder like `real` whose bin/ptxas keeps a copy of each PTX module in
  work/ptx (see _PTXAS_WRAPPER); everything else links to `real`."""
  root = work / "cuda"
  shutil.rmtree(root, ignore_errors=True)  # A work folder of an earlier run is reused.
  (root / "bin").mkdir(parents=True)
  (work / "ptx").mkdir(exist_ok=True)
  for entry in real.iterdir():
    if entry.name != "bin":
      (root / entry.name).symlink_to(entry)
  for tool in (real / "bin").iterdir():
    if tool.name != "ptxas":
      (root / "bin" / tool.name).symlink_to(tool)
  wrapper = root / "bin" / "ptxas"
  wrapper.write_text(_PTXAS_WRAPPER.format(keep=work / "ptx", real=real / "bin" / "ptxas"))
  wrapper.chmod(0o755)
  return root


def prepare_environment(work: Path) -> None:
  """Sets up this process (before jax is imported) to compile for an H200 without one.

  Args:
    work: a scratch folder for XLA's dumps, the PTX XLA compiles and a ptxas wrapper
      that keeps it.
  """
  if "jax" in sys.modules:
    raise RuntimeError("prepare_environment must run before jax is imported.")
  plugin = _plugin_library()
  ptxas = _ptxas_dir()
  cuda = _cuda_root_keeping_ptx(ptxas.parent, work)
  os.environ["PATH"] = f"{cuda / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
  os.environ.update(
      JAX_PLATFORMS="cpu",  # the stand-in driver must not become jax's default backend
      JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1",  # no cuDNN/cuBLAS here: nothing runs
      TF_CPP_MIN_LOG_LEVEL="0",
      TF_CPP_VMODULE="subprocess_compilation=3",  # XLA logs ptxas's -v output at this level
      # The dump's thunk sequence names each Pallas kernel's launch (grid, threads, smem).
      XLA_FLAGS=f"--xla_dump_to={work / 'xla'} --xla_gpu_ptx_compiler_extra_flags=-v",
      CUDA_ROOT=str(cuda),  # where jax tells XLA to find ptxas (ahead of nvidia-cuda-nvcc)
      MOSAIC_GPU_CUDA_ROOT=str(ptxas.parent),
      # Printed to stdout (no MOSAIC_GPU_DUMP_TO: that would also write every pass's IR).
      MOSAIC_GPU_DUMP_PTXAS="1",
      MOSAIC_GPU_DUMP_PTX="1",
      MOSAIC_GPU_DUMP_RESOURCES="1",
  )
  stand_in = build_driver_stand_in(plugin, Path.home() / ".cache" / "stellarax")
  # Loaded first under the soname libcuda.so.1, it is what the plugin's dlopen finds.
  ctypes.CDLL(str(stand_in), mode=ctypes.RTLD_GLOBAL)


def _flush_all() -> None:
  """Flushes Python's and C's buffered output (C++ code prints through C stdio)."""
  sys.stdout.flush()
  sys.stderr.flush()
  ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def captured_output(fd: int) -> Iterator[list[str]]:
  """Captures what is written to file descriptor `fd` (1 or 2), by Python or C++ code
  (XLA's log, Mosaic GPU's dumps), into `[text]`."""
  _flush_all()
  saved = os.dup(fd)
  holder: list[str] = []
  with tempfile.TemporaryFile() as tmp:
    os.dup2(tmp.fileno(), fd)
    try:
      yield holder
    finally:
      _flush_all()
      os.dup2(saved, fd)
      os.close(saved)
      tmp.seek(0)
      holder.append(tmp.read().decode(errors="replace"))


# ----------------------------------------------------------------------------- compiling


class H200Compiler:
  """Compiles jitted programs for a deviceless H200 and collects their kernels' stats."""

  def __init__(self, work: Path):
    import jax
    from jax.experimental import topologies
    self.work = work
    topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                            target_config=TARGET_CONFIG.read_text())
    self.mesh = jax.sharding.Mesh(topology.devices, ("x",))
    import jax_plugins.xla_cuda13 as cuda_plugin
    self._mosaic_compile = ctypes.CDLL(cuda_plugin._get_library_path()).MosaicGpuCompile
    self._mosaic_compile.argtypes = [ctypes.c_char_p, ctypes.c_int]
    self._mosaic_compile.restype = ctypes.c_void_p

  def on_h200(self, specs) -> list[Any]:
    """`specs` (ShapeDtypeStructs) placed on the H200, so programs lower for CUDA."""
    import jax
    sharding = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in specs]

  def capture(self, fn, specs) -> list[Any]:
    """The stellarax op calls (BoundArguments) of `fn(*specs)` lowered for the H200."""
    import jax
    from stellarax.autotuning import capture
    with jax.set_mesh(self.mesh), captured_output(1):  # Mosaic GPU's resource report
      return capture.get_bound_args(fn, *self.on_h200(specs))

  def compile(self, fn, specs) -> list[KernelStats]:
    """Compiles `fn(*specs)` (ShapeDtypeStructs) for the H200: the whole program through
    XLA (Triton kernels and XLA's own), then each Mosaic GPU kernel in it.

    Returns:
      Stats of every kernel ptxas compiled, Pallas ones first.

    Raises:
      Exception: whatever lowering or compiling raised (a kernel that cannot compile).
    """
    import jax
    args = self.on_h200(specs)
    shutil.rmtree(self.work / "xla", ignore_errors=True)
    for old in (self.work / "ptx").glob("*.ptx"):
      old.unlink()
    with jax.set_mesh(self.mesh):
      with captured_output(1) as printed:  # Mosaic GPU's resource report
        lowered = jax.jit(fn).trace(*args).lower()
      # XLA's compile also compiles the Mosaic GPU kernels, printing their PTX and
      # ptxas's report (read below, one module at a time, from their own compile).
      with captured_output(1), captured_output(2) as log:
        lowered.compile()
    resources = [int(m) for m in _SMEM_SCRATCH.findall(printed[0])]
    stats = parse_ptxas(log[0])
    ptx_of: dict[str, str] = {}  # entry function -> its PTX module
    for path in (self.work / "ptx").glob("*.ptx"):
      ptx = path.read_text(errors="replace")
      for name, traits in ptx_traits(ptx).items():
        if name in stats:
          stats[name].apply(traits)
          ptx_of[name] = ptx
    launches: dict[str, Any] = {}
    for path in (self.work / "xla").glob("*thunk_sequence.txt"):
      launches.update(parse_thunk_sequence(path.read_text()))
    for name, (grid, threads, smem) in launches.items():
      if name in stats:
        stats[name].grid, stats[name].threads, stats[name].shared_memory = grid, threads, smem
    triton_names, mosaic_modules = _pallas_calls(lowered)
    pallas = [stats.pop(name) for name in triton_names if name in stats]
    for k in pallas:
      k.pallas = True
      if k.spills:
        locate_spills(k, ptx_of[k.name], self.work)
    mosaic = self._compile_mosaic(mosaic_modules, resources)
    mosaic_names = {k.name for k in mosaic}
    xla_own = [k for name, k in stats.items() if name not in mosaic_names]
    return pallas + mosaic + xla_own

  def _compile_mosaic(self, modules: list[bytes], resources: list[int]) -> list[KernelStats]:
    """Each Mosaic GPU kernel module through ptxas; `resources` are their shared memory
    sizes in lowering order."""
    out = []
    for i, module in enumerate(modules):
      # The PTX and ptxas's report go to stdout; the compile fails at the module load.
      with captured_output(1) as printed, captured_output(2) as log:
        self._mosaic_compile(module, len(module))
      found = parse_ptxas(printed[0])
      if not found:
        raise RuntimeError(f"Mosaic GPU compile produced no ptxas output: {log[0][-2000:]}")
      traits = ptx_traits(printed[0])
      for k in found.values():
        k.shared_memory = resources[i] if len(resources) == len(modules) else None
        k.apply(traits.get(k.name))
        k.pallas = True
        if k.spills:
          locate_spills(k, _printed_ptx(printed[0]), self.work)
      out.extend(found.values())
    return out


def _pallas_calls(lowered) -> tuple[list[str], list[bytes]]:
  """The Pallas kernels of a lowered program: the Triton kernels' names and the Mosaic
  GPU kernels' serialized modules, in program order. (XLA launches its own fusions
  the same way, so the thunk sequence cannot tell them apart.)"""
  from jax._src.lib.mlir import ir
  from stellarax.ops import pallas_backends
  # The target Pallas Triton's calls carry; where JAX has dropped the backend there are
  # none to find, and the Mosaic GPU and XLA kernels still compile.
  triton_target = (pallas_backends.triton.CUSTOM_CALL_TARGET_NAME
                   if pallas_backends.missing_reason("triton") is None else None)
  triton, mosaic = [], []

  def config(op):
    for name in ("mhlo.backend_config", "backend_config"):
      if name in op.attributes and isinstance(op.attributes[name], ir.DictAttr):
        return ir.DictAttr(op.attributes[name])
    return None

  def walk(op):
    for region in op.regions:
      for block in region:
        for inner in block:
          if inner.name == "stablehlo.custom_call":
            target = ir.StringAttr(inner.attributes["call_target_name"]).value
            attrs = config(inner)
            if target == "mosaic_gpu_v2" and attrs is not None:
              mosaic.append(ir.StringAttr(attrs["module"]).value_bytes)
            elif triton_target is not None and target == triton_target and attrs is not None:
              triton.append(ir.StringAttr(attrs["name"]).value)
          walk(inner)

  walk(lowered.compiler_ir("stablehlo").operation)
  return triton, mosaic


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass
class Row(_SpilledBytes):
  """One compiled kernel of one config (or the config's compile error): a line of
  kernels.json. The kernel's fields are KernelStats' of the same names."""
  workload: str
  op: str
  config: str
  kernel: str = ""
  registers: int | None = None
  spill_stores: int = 0
  spill_loads: int = 0
  shared_memory: int | None = None
  threads: int | None = None
  grid: tuple[int, ...] | None = None
  tensor_cores: str | None = None
  async_copies: str | None = None
  global_load_bits: int | None = None
  unfenced_async_reads: int | None = None
  spills_in_loops: int | None = None
  spills_in_outer_loops: int | None = None
  pallas: bool = True  # False for XLA's own kernels (fusions) in the same program
  heuristic: bool = False
  target: bool = True  # a gpu_check workload held to the speed targets' standard (compile_strict)
  status: str = "ok"
  remarks: list[str] = dataclasses.field(default_factory=list)
  seconds: float = 0.0
  item: int = 0  # the config's place in the run's fixed order (workers of --jobs share it)


# The fields a Row takes from its kernel's KernelStats.
_KERNEL_FIELDS = ({f.name for f in dataclasses.fields(Row)}
                  & {f.name for f in dataclasses.fields(KernelStats)})


def more_workloads() -> list[Any]:
  """Compile-only workloads besides the speed targets: attention's other head dims and
  float16 (GQA, key lengths), attention with a bias and a mask, ragged_dot and the norms
  at sizes no tile divides. Their
  configs must compile; their spills are reported, not failed on."""
  import jax
  import jax.numpy as jnp
  import stellarax
  from gpu_check import Workload

  def gradient_workload(name, family, call, shapes, num_differentiable):
    """The gradient of call(op, *inputs) in its first `num_differentiable` inputs, whose
    (shape, dtype) are `shapes` (compile only: no inputs, no reference)."""
    specs = lambda: tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes)
    program = lambda op, *a: _gradient(functools.partial(call, op), a, num_differentiable)
    return Workload(f"{name} fwd+bwd", family, None, program, None, specs=specs)

  def attention(b, t, n, k, h, dtype, **options):
    call = lambda op, q, kk, v, lens: stellarax.dot_product_attention(
        q, kk, v, key_value_seq_lengths=lens, **options, implementation=op)
    shapes = [((b, t, n, h), dtype), ((b, t, k, h), dtype), ((b, t, k, h), dtype), ((b,), jnp.int32)]
    return gradient_workload(f"attention B={b} T={t} N={n} K={k} H={h} {jnp.dtype(dtype).name} "
                             f"{options}", "attention", call, shapes, 3)

  def biased_attention(b, t, n, h, dtype):
    """A bias and a mask of (query, key) tiles: the kernels' pair operand and its floor."""
    call = lambda op, q, kk, v, bias, mask: stellarax.dot_product_attention(
        q, kk, v, bias, mask, implementation=op)
    shapes = [((b, t, n, h), dtype)] * 3 + [((b, n, t, t), dtype), ((b, 1, t, t), jnp.bool_)]
    return gradient_workload(f"attention B={b} T={t} N={n} H={h} {jnp.dtype(dtype).name} "
                             "bias and mask", "attention", call, shapes, 3)

  def ragged(m, k, n, g, dtype):
    call = lambda op, lhs, rhs, sizes: stellarax.ragged_dot(lhs, rhs, sizes, implementation=op)
    shapes = [((m, k), dtype), ((g, k, n), dtype), ((g,), jnp.int32)]
    return gradient_workload(f"ragged_dot G={g} M={m} K={k} N={n} {jnp.dtype(dtype).name}",
                             "ragged_dot", call, shapes, 2)

  def norm(rows, cols, dtype):
    call = lambda op, x, scale, offset: stellarax.layer_norm(x, scale, offset, implementation=op)
    shapes = [((rows, cols), dtype), ((cols,), dtype), ((cols,), dtype)]
    return gradient_workload(f"layer_norm ({rows}, {cols}) {jnp.dtype(dtype).name}",
                             "layer_norm", call, shapes, 3)

  return [
      attention(2, 2048, 16, 4, 64, jnp.float16, is_causal=True),
      attention(2, 2048, 8, 8, 256, jnp.bfloat16, local_window_size=(512, 0)),
      biased_attention(1, 2048, 8, 128, jnp.bfloat16),
      ragged(1000, 512, 768, 5, jnp.float16),
      norm(1000, 5000, jnp.bfloat16),
  ]


def _gradient(f, args, num_differentiable):
  """The gradient of gpu_check's loss of f(*args) (`_grad_of`: a sum of sin, which reads
  f's values; jax 0.12 drops a forward kernel whose output the gradient of a plain sum
  never reads) in its first `num_differentiable` arguments."""
  from gpu_check import _grad_of
  rest = args[num_differentiable:]
  return _grad_of(lambda *a: f(*a, *rest), tuple(range(num_differentiable)))(*args[:num_differentiable])


def _pallas_ops(family: str) -> list[Any]:
  from stellarax.core import registry
  return [registry.lookup(n)() for n in registry.names(family)
          if "pallas" in n and not n.endswith("_vjp")]


def _program_of(workload, op):
  """The workload's program (forward, or forward and gradient) with `op` in it."""
  return functools.partial(workload.call, op)


def run(args, work: Path, worker: int = 0, workers: int = 1) -> list[Row]:
  """Compiles the configs of every workload (module doc) and returns their rows.

  Args:
    args: the parsed command line (`--space`, `--only`).
    work: the scratch folder `prepare_environment` set up.
    worker, workers: compile only the configs whose place in the fixed order is
      `worker` modulo `workers` (each worker of a parallel run lists them all).

  Returns:
    A Row per compiled kernel (or per config that failed to compile, or per op a
    workload does not support), in the fixed order.
  """
  sys.path.insert(0, str(HERE))
  import gpu_check
  from stellarax.autotuning import search

  compiler = H200Compiler(work)
  only = [s.strip() for s in (args.only or "").split(",") if s.strip()]
  rows: list[Row] = []
  seen: set[str] = set()
  item = 0
  targets = gpu_check._workloads(smoke=False)
  for w in targets + more_workloads():
    if only and not any(s in w.name for s in only):
      continue
    # gpu_check's workloads are held to the speed targets' standard unless they opt out.
    target = w in targets and w.compile_strict
    print(f"-- {w.name}", flush=True)
    specs = w.input_specs()
    for op in _pallas_ops(w.family):
      try:
        calls = compiler.capture(_program_of(w, op), specs)
      except NotImplementedError as e:
        if worker == 0:
          rows.append(Row(w.name, op.name, "", status=f"not supported: {str(e)[:120]}",
                          item=item))
        item += 1
        continue
      for ba in calls:
        identity = ba.op_json() + ba.key_json()
        if identity in seen or "pallas" not in (ba.op.name or ""):
          continue
        seen.add(identity)
        heuristic = ba.heuristics_config
        # A fixed order (the space is a set): the same variants compile in every run.
        space = sorted(ba.autotuning_configs, key=str)
        configs = [heuristic] + ([c for c in space if c != heuristic] if args.space
                                 else search.code_path_variants(heuristic, space))
        for config in configs:
          if item % workers == worker:
            new = _compile_one(compiler, w.name, ba, config, config == heuristic, target, item)
            rows.extend(new)
            _print_rows(new)
          item += 1
  return rows


def _compile_one(compiler, workload, ba, config, heuristic, target, item) -> list[Row]:
  start = time.monotonic()
  base = dict(workload=workload, op=ba.op.name, config=str(config), heuristic=heuristic,
              target=target, item=item)
  try:
    kernels = compiler.compile(ba.runner(config), ba.array_specs())
  except Exception as e:  # a kernel that does not compile is a finding, not a crash
    first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return [Row(**base, status=f"compile error: {first[:300]}", seconds=time.monotonic() - start)]
  seconds = time.monotonic() - start
  return [Row(**base, kernel=k.name, **{name: getattr(k, name) for name in _KERNEL_FIELDS},
              status=_status(k), seconds=seconds) for k in kernels]


_UNFENCED = "UNFENCED SMEM"


def _status(k: KernelStats) -> str:
  """"ok", or what makes the kernel wrong (shared memory read through the async proxy
  after an unfenced store: UNFENCED SMEM, first) or slow: spills (unless the SASS shows
  them all outside loops), serialized wgmma, a matmul that copies no operand
  asynchronously (nothing overlaps its loads), or a memory-bound kernel without 16-byte
  loads."""
  # mma.sync is not a fault by itself: Triton takes it for tiles of fewer than 64 rows
  # (wgmma's smallest), e.g. the 16-row tiles of decode-sized ragged_dot.
  matmul = k.tensor_cores in ("wgmma", "mma")
  streams = k.tensor_cores == "none" and k.async_copies == "none"
  # Spills that the SASS shows outside the step loops cost a few accesses per kernel
  # (or per tile).
  spills = k.spills and k.spills_in_loops != 0
  bad = [flag for flag, on in (
      (_UNFENCED, bool(k.unfenced_async_reads)),
      ("SPILLS", spills),
      ("WGMMA SERIALIZED", k.wgmma_serialized),
      ("NOT PIPELINED", matmul and k.async_copies == "none"),
      ("NARROW LOADS", streams and 0 < (k.global_load_bits or 0) < 128),
  ) if on]
  return ", ".join(bad) or "ok"


def _print_rows(rows: list[Row]) -> None:
  """Prints the Pallas kernels' rows (XLA's own fusions are in kernels.json only)."""
  for r in rows:
    if not r.pallas:
      continue
    smem = f"{r.shared_memory / 1024:.0f}K" if r.shared_memory is not None else "-"
    spills = f"{r.spill_stores}/{r.spill_loads}" if r.spills else "0"
    if r.spills and r.spills_in_loops is not None:
      spills += f" L{r.spills_in_loops}"
      if r.spills_in_outer_loops:
        spills += f"+{r.spills_in_outer_loops}o"
    remarks = ",".join(sorted({m.split()[0] for m in r.remarks}))
    loads = f"{r.async_copies or '-'}/{r.global_load_bits or 0}"
    print(f"{r.op:34s} {r.kernel[:40]:40s} {str(r.registers or '-'):>4s} {spills:>12s} {smem:>6s} "
          f"{r.tensor_cores or '-':5s} {loads:12s} {'H' if r.heuristic else ' '} {r.status[:60]:12s} "
          f"{remarks:11s} {r.config[:110]}", flush=True)


@dataclasses.dataclass(frozen=True)
class Verdict:
  """What the compiled rows say: which kernels failed, read shared memory unfenced or
  are slow, which slow ones a heuristic config chose (slow defaults) and which of those
  fail the check (`blocking`)."""
  rows: tuple[Row, ...]
  failed: tuple[Row, ...]
  unfenced: tuple[Row, ...]
  slow: tuple[Row, ...]
  slow_defaults: tuple[Row, ...]
  blocking: tuple[Row, ...]

  @classmethod
  def of(cls, rows: list[Row], *, spills_block: bool = True) -> "Verdict":
    """Sorts `rows` (from `run`) into the verdict's groups.

    Args:
      rows: the compiled rows.
      spills_block: whether a heuristic config's spills at a speed target fail the
        check; False for a jax newer than the pin (`--spills-advisory`): its compiler
        allocates registers a little differently (the rms_norm backward, at the
        128-register cap of 16 warps, spills 16 B on jax 0.12.1 and none on 0.11.2),
        and the targets are held on the jax the GPU machine runs.
    """
    failed = tuple(r for r in rows if r.status.startswith("compile error"))
    unfenced = tuple(r for r in rows if r.status.startswith(_UNFENCED))
    slow = tuple(r for r in rows if r.pallas and r.status != "ok"
                 and not r.status.startswith(("compile error", "not supported", _UNFENCED)))
    slow_defaults = tuple(r for r in slow if r.heuristic)
    blocking = tuple(r for r in slow_defaults if "WGMMA SERIALIZED" in r.status
                     or (r.target and (spills_block or r.status != "SPILLS")))
    return cls(tuple(rows), failed, unfenced, slow, slow_defaults, blocking)

  @property
  def passed(self) -> bool:
    """False on any failed or unfenced kernel or blocking slow default.

    A config that cannot compile is a bug wherever it comes from (a tuner would waste a
    candidate on it), and so is one whose kernel may read stale shared memory. A slow
    heuristic config blocks at a speed target, and anywhere when its wgmma are
    serialized: that costs the tensor cores' overlap, not a few accesses (the
    GQA workloads found one that only jax 0.12 showed). Other slow
    defaults (a few spills in a loop of a compile-only workload) are printed."""
    return not (self.failed or self.unfenced or self.blocking)

  def summary(self) -> str:
    """The one-line count printed last."""
    return (f"{len(self.rows)} kernels compiled for an H200: {len(self.failed)} failed to "
            f"compile, {len(self.unfenced)} read shared memory after an unfenced store, "
            f"{len(self.slow)} slow (spills in loops or unlocated, serialized wgmma, "
            f"unpipelined matmul or narrow loads; {len(self.slow_defaults)} with a heuristic "
            f"config, {sum(r.target for r in self.slow_defaults)} of them at a speed target, "
            f"{len(self.blocking)} failing the check)")


def _worker_spec(text: str) -> tuple[int, int]:
  """`--worker i/n` as (i, n)."""
  match = re.fullmatch(r"(\d+)/(\d+)", text)
  if not match or not int(match[1]) < int(match[2]):
    raise argparse.ArgumentTypeError(f"--worker takes i/n with 0 <= i < n, got {text!r}")
  return int(match[1]), int(match[2])


def _default_jobs() -> int:
  """Processes for a run: one a core (a compile is one thread: ptxas, or XLA on one
  kernel), at most 4 (each worker holds its own jax)."""
  return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                    else os.cpu_count() or 1))


def run_in_workers(argv: list[str], out: Path, jobs: int, script: Path | None = None) -> list[Row]:
  """Runs `jobs` workers of this script (`--worker i/jobs`), each compiling its share of
  the configs into out/worker-i, and returns all their rows in the fixed order.

  Args:
    argv: the options every worker takes (`--space`, `--only ...`).
    out: the run's folder; worker i writes out/worker-i/kernels.json and its output
      to out/worker-i.log.
    jobs: how many workers.
    script: the worker program (this file; a test passes a stand-in).

  Returns:
    The workers' rows, sorted by their place in the fixed order.

  Raises:
    SystemExit: naming a worker that failed, with the end of its output.
  """
  out.mkdir(parents=True, exist_ok=True)
  procs = []
  for i in range(jobs):
    folder = out / f"worker-{i}"
    log = (out / f"worker-{i}.log").open("w")
    cmd = [sys.executable, str(script or Path(__file__).resolve()), *argv, "--out", str(folder),
           "--worker", f"{i}/{jobs}"]
    procs.append((i, folder, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
  rows: list[Row] = []
  failed = []
  for i, folder, log, proc in procs:
    proc.wait()
    log.close()
    if proc.returncode != 0 or not (folder / "kernels.json").exists():
      tail = (out / f"worker-{i}.log").read_text(errors="replace")[-3000:]
      failed.append(f"worker {i}/{jobs} exited with {proc.returncode}:\n{tail}")
      continue
    for record in json.loads((folder / "kernels.json").read_text()):
      record["grid"] = tuple(record["grid"]) if record["grid"] else None
      rows.append(Row(**record))
  if failed:
    raise SystemExit("compile_h200: " + "\n".join(failed))
  return sorted(rows, key=lambda r: r.item)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="folder for kernels.json")
  parser.add_argument("--space", action="store_true", help="compile every config of each search space")
  parser.add_argument("--only", default="", help="comma-separated workload name parts")
  parser.add_argument("--jobs", type=int, default=None,
                      help="processes compiling side by side (default: one a core, at most 4); "
                           "each worker's output goes to <out>/worker-<i>.log")
  parser.add_argument("--spills-advisory", action="store_true",
                      help="print a heuristic config's spills at a speed target, do not fail on "
                           "them (for a jax newer than the pin: see Verdict.of)")
  parser.add_argument("--worker", type=_worker_spec, default=None,
                      help="(internal) compile only share i of n and write its rows, no verdict")
  args = parser.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  jobs = _default_jobs() if args.jobs is None else args.jobs
  if jobs < 1:
    parser.error(f"--jobs must be at least 1, got {jobs}")
  if args.worker is None and jobs > 1:
    shared = (["--space"] if args.space else []) + (["--only", args.only] if args.only else [])
    start = time.monotonic()
    print(f"compiling in {jobs} processes (their output: {out}/worker-*.log)", flush=True)
    rows = run_in_workers(shared, out, jobs)
    print(f"compiled in {time.monotonic() - start:.0f} s", flush=True)
  else:
    work = Path(tempfile.mkdtemp(prefix="compile_h200_"))
    prepare_environment(work)
    worker, workers = args.worker or (0, 1)
    rows = run(args, work, worker, workers)
    shutil.rmtree(work, ignore_errors=True)
  (out / "kernels.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
  if args.worker is not None:
    return 0
  return report(rows, spills_block=not args.spills_advisory)


def report(rows: list[Row], *, spills_block: bool = True) -> int:
  """Prints the Pallas kernels' rows by workload and the verdict (`Verdict.of`'s
  `spills_block`); returns the exit code (0 when the verdict passes, else 1)."""
  print("\n== kernels (H = heuristic config; spills = bytes stored/loaded, Ln = n spill"
        " instructions inside the SASS's step loops, +mo: m in outer (per-tile) loops;"
        " loads = async copy kind / widest global load in bits) ==")
  print(f"{'op':34s} {'kernel':40s} {'regs':>4s} {'spills':>12s} {'smem':>6s} {'mma':5s} "
        f"{'loads':12s}   {'status':12s} {'ptxas':11s} config")
  for workload in dict.fromkeys(r.workload for r in rows):
    print(f"-- {workload}")
    _print_rows([r for r in rows if r.workload == workload])
  print(f"(and {sum(not r.pallas for r in rows)} kernels of XLA's own, in kernels.json)")
  verdict = Verdict.of(rows, spills_block=spills_block)
  print(f"\n{verdict.summary()}")
  for r in verdict.slow_defaults:
    failing = " (fails the check)" if r in verdict.blocking else ""
    print(f"slow default{failing}: {r.workload}: {r.op} {r.kernel}: {r.status}")
  for r in verdict.unfenced:
    print(f"unfenced: {r.workload}: {r.op} {r.kernel}: {r.unfenced_async_reads} async reads "
          f"({r.config[:120]})")
  return 0 if verdict.passed else 1


if __name__ == "__main__":
  sys.exit(main())
