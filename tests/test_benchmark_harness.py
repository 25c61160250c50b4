"""The peer benchmarks' harness: interleaving, output folder, interpreters.

Pure Python and fast: no contender is built here (`benchmarks/run.py
--smoke --out DIR` runs every path of the harness at small sizes).
"""

import os

import pytest

from benchmarks import common
from benchmarks import peers
from benchmarks.harness import run


def test_interleave_takes_one_step_of_each_in_turn():
  calls = []
  steps = {name: (lambda k, name=name: calls.append((name, k)))
           for name in ('a', 'b', 'c')}
  # a: 1 warm-up + 3 timed; b: 0 + 2; c: 0 + 3.
  plans = {'a': (1, 3, 3, 0.0), 'b': (0, 2, 2, 0.0), 'c': (0, 3, 3, 0.0)}
  out = common.interleave(steps, plans)
  assert calls == [('a', 0), ('b', 0), ('c', 0),
                   ('a', 1), ('b', 1), ('c', 1),
                   ('a', 2), ('c', 2),
                   ('a', 3)]
  assert [out[n]['n'] for n in 'abc'] == [3, 2, 3]


def test_interleave_flushes_the_caches_before_every_step_untimed(
    monkeypatch):
  # A clock that only the steps (1 ms each) and the flushes (1 s) move.
  clock = [0.0]
  monkeypatch.setattr(common.time, 'perf_counter', lambda: clock[0])
  calls = []

  def step(name):
    def run(k):
      calls.append(name)
      clock[0] += 0.001
    return run

  def flush():
    calls.append('flush')
    clock[0] += 1.0

  out = common.interleave({'a': step('a'), 'b': step('b')},
                          {'a': (1, 2, 2, 0.0), 'b': (0, 2, 2, 0.0)},
                          before=flush)
  assert calls == ['flush', 'a', 'flush', 'b', 'flush', 'a', 'flush', 'b',
                   'flush', 'a']
  assert out['a']['median_ms'] == pytest.approx(1.0)
  assert out['b']['median_ms'] == pytest.approx(1.0)


def test_the_cache_flusher_writes_at_least_64_mib_and_what_it_is_asked():
  assert common.cache_flusher().nbytes >= 64 * 2**20
  flush = common.cache_flusher(2**20)
  flush()
  assert flush.nbytes == 2**20


def test_interleave_drops_a_contender_whose_step_raises():
  calls = []

  def bad(k):
    if k == 1:
      raise RuntimeError('out of memory')
    calls.append(('bad', k))

  out = common.interleave(
      {'bad': bad, 'good': lambda k: calls.append(('good', k))},
      {'bad': (0, 4, 4, 0.0), 'good': (0, 4, 4, 0.0)})
  assert out['bad'] == {'error': 'RuntimeError: out of memory'}
  assert out['good']['n'] == 4
  assert calls == [('bad', 0), ('good', 0), ('good', 1), ('good', 2),
                   ('good', 3)]


def test_a_run_never_writes_over_the_committed_results(tmp_path):
  for name in ('', 'quick', 'full', 'quick-2026-11-28/run1'):
    with pytest.raises(SystemExit, match='committed results folder'):
      run._check_out(os.path.join(run.RESULTS, name))
  assert run._check_out(os.path.join(run.RESULTS, 'tmp_mine')).endswith(
      'tmp_mine')
  assert run._check_out(str(tmp_path)) == str(tmp_path)


def test_peer_interpreters_come_from_the_flag_or_the_variable(monkeypatch):
  monkeypatch.delenv('LAZY_OPTAX_TF_PYTHON', raising=False)
  assert peers.python_for('tf') is None
  assert peers.why_unusable(None) == 'not given'
  monkeypatch.setenv('LAZY_OPTAX_TF_PYTHON', '/opt/tf/bin/python')
  assert peers.python_for('tf') == '/opt/tf/bin/python'
  assert peers.python_for('tf', '/usr/bin/python3') == '/usr/bin/python3'
  assert 'not an executable' in peers.why_unusable('/opt/tf/bin/python')


def test_quick_mode_plans_every_contender_at_both_thread_counts():
  groups = run._plan('quick')
  assert [(g['cfg']['sweep'], g['cfg']['threads']) for g in groups] == [
      ('target', 1), ('target', 2), ('dlrm', 1), ('dlrm', 2)]
  assert all(g['rounds'] == run.ROUNDS >= 3 for g in groups)
  assert groups[0]['contenders'] == list(run.QUICK_CONTENDERS)
  # Each contender in a process of its own, in its framework's interpreter.
  processes = [run.process_of(c) for c in groups[0]['contenders']]
  assert len(set(processes)) == len(processes)
  assert {(m, peer) for m, peer, _ in processes} == {
      ('contenders', ''), ('tf_contender', 'tf'),
      ('fbgemm_contender', 'fbgemm')}
