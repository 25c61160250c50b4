"""Hashed ids never collide silently, and bad arguments get clear errors.

Without `jax_enable_x64`, `jax.jit` cuts NumPy int64 arguments to int32
silently, so inside a trace `2**32 + 3` is `3`. These tests check that every
entry point refuses such ids (at trace time under jit, on the host before
any cast outside it), that the lossless forms give distinct rows, and that
every bad argument of `IdTable`, `reset_rows` and `split_ids` is named.
"""

import json
import re
import textwrap

import fork_server
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lazy_optax
from lazy_optax._src import id_words

_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')

# One round and no eviction log: the cheapest assign to compile. Each
# compiled function below is shared, and every batch holds 2 ids.
TABLE = lazy_optax.IdTable(capacity=64, probe=8, rounds=1, eviction_log=0)
PAIR = np.array([3, 2 ** 32 + 3], np.int64)     # equal once cut to int32
SPLIT = 'lazy_optax.split_ids'
ASSIGN_WORDS = jax.jit(lambda s, w: TABLE.assign(s, w, step=0))
ASSIGN_32 = jax.jit(lambda s, i: TABLE.assign(s, i, step=0,
                                              ids_are_32bit=True))
FIND = jax.jit(TABLE.find)
# A table of 8 slots (one window), shared by two tests below with batches
# of 2 ids: its assign is traced once.
SMALL = lazy_optax.IdTable(capacity=8, rounds=1, eviction_log=0)


# -- 1. no silent collision ---------------------------------------------------

def test_jitted_assign_and_find_refuse_int64_ids_cut_at_the_jit_boundary():
  with pytest.raises(TypeError, match=f'traced int32 raw_ids.*{SPLIT}'):
    jax.jit(TABLE.assign)(TABLE.init(), PAIR, 0)
  with pytest.raises(TypeError, match=f'IdTable.find: .*{SPLIT}'):
    jax.jit(TABLE.find)(TABLE.init(), PAIR)
  # split_ids itself cannot launder a cut id into words inside jit.
  with pytest.raises(TypeError, match='traced int32 ids'):
    jax.jit(lazy_optax.split_ids)(PAIR)
  # Any trace, not only jit.
  with pytest.raises(TypeError, match='traced int32'):
    jax.eval_shape(lambda s, i: TABLE.assign(s, i, step=0), TABLE.init(),
                   jnp.arange(4))


def test_eager_int64_and_jitted_words_give_two_ids_two_rows():
  slots, state, fresh = TABLE.assign(TABLE.init(), PAIR, step=0)
  slots = np.asarray(slots)
  assert slots[0] != slots[1] and (slots < TABLE.capacity).all()
  # The table holds the full 64-bit ids (read back on the host).
  held = id_words.join_words(np.asarray(state.ids)[slots])
  np.testing.assert_array_equal(held, PAIR)
  np.testing.assert_array_equal(
      id_words.join_words(np.asarray(fresh.ids)), PAIR)
  # Under jit, the split_ids words: the same slots as eagerly; find serves
  # each id its own row.
  words = lazy_optax.split_ids(PAIR)
  jit_slots, jit_state, _ = ASSIGN_WORDS(TABLE.init(), words)
  np.testing.assert_array_equal(np.asarray(jit_slots), slots)
  np.testing.assert_array_equal(np.asarray(FIND(jit_state, words)), slots)
  # Ids never assigned, that share their low word with live ones: absent.
  other = lazy_optax.split_ids(np.array([2 ** 33 + 3, 2 ** 34 + 3]))
  np.testing.assert_array_equal(np.asarray(FIND(jit_state, other)),
                                [TABLE.capacity] * 2)


def test_ids_are_32bit_opts_in_and_is_checked_where_concrete():
  ids = np.array([2 ** 31 - 1, 5], np.int64)
  want, state, _ = TABLE.assign(TABLE.init(), ids, step=0)  # host, lossless
  got, _, _ = ASSIGN_32(TABLE.init(), ids.astype(np.int32))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(
      np.asarray(FIND(state, lazy_optax.split_ids(ids))), np.asarray(want))
  words = jax.jit(lambda i: lazy_optax.split_ids(i, ids_are_32bit=True))(
      ids.astype(np.int32))
  np.testing.assert_array_equal(id_words.join_words(words), ids)
  for call in (lambda: TABLE.assign(TABLE.init(), PAIR, step=0,
                                    ids_are_32bit=True),
               lambda: TABLE.find(TABLE.init(), PAIR, ids_are_32bit=True),
               lambda: lazy_optax.split_ids(PAIR, ids_are_32bit=True)):
    with pytest.raises(ValueError, match=r'ids_are_32bit=True, but .* holds '
                       r'4294967299 at flat position 1'):
      call()
  with pytest.raises(TypeError, match='ids_are_32bit must be a bool'):
    TABLE.assign(TABLE.init(), PAIR, step=0, ids_are_32bit=1)


def test_under_x64_traced_int64_ids_are_kept_whole():
  # A fresh process: x64 is a process-wide switch.
  code = textwrap.dedent('''
      import json
      import jax
      jax.config.update('jax_enable_x64', True)
      import numpy as np
      import lazy_optax
      table = lazy_optax.IdTable(capacity=64, probe=8, rounds=1,
                                 eviction_log=0)
      pair = np.array([3, 2 ** 32 + 3], np.int64)
      slots = jax.jit(table.assign)(table.init(), pair, 0)[0]
      try:   # int32 stays refused under x64: one rule
        jax.eval_shape(lambda s, i: table.assign(s, i, step=0),
                       table.init(), pair.astype(np.int32))
        refused = False
      except TypeError:
        refused = True
      print(json.dumps([str(slots.dtype), np.asarray(slots).tolist(),
                        refused]))
  ''')
  # Run as `python -c code` runs it, in a forked child of a process that
  # imported jax and lazy_optax once (tests/fork_server.py; the preloaded
  # modules of tests/test_kernel_cache.py's, so one server serves both).
  (proc,) = fork_server.run_scripts([code], {}, preloaded=_PRELOADED)
  assert proc.returncode == 0, proc.stderr[-3000:]
  dtype, slots, refused = json.loads(proc.stdout.strip().splitlines()[-1])
  assert refused
  # The slots of the whole ids, as the host conversion gives them here.
  want, _, _ = TABLE.assign(TABLE.init(), PAIR, step=0)
  assert dtype == 'int32' and slots == np.asarray(want).tolist()
  assert slots[0] != slots[1]


def test_concrete_int64_ids_beyond_the_table_are_out_of_range():
  table = jnp.arange(16.).reshape(8, 2)
  bad = np.array([1, 2 ** 32 + 3], np.int64)
  message = r'id 4294967299 at position \[?1\]? is out of range for a table ' \
            r'of 8 rows'
  with pytest.raises(ValueError, match=message):
    lazy_optax.lookup(table, bad)
  with pytest.raises(ValueError, match=message):
    lazy_optax.lookup(table, bad, padding_id=3)
  with pytest.raises(ValueError, match='id 4294967299 at position'):
    lazy_optax.lookup_bag(table, bad[None, :])
  with pytest.raises(ValueError, match=message):
    lazy_optax.SparseRows(bad, np.ones((2, 2), np.float32), 8)
  # Under jit, a NumPy constant is still on the host: checked too.
  with pytest.raises(ValueError, match=message):
    jax.jit(lambda t: lazy_optax.lookup(t, bad))(table)
  # In range, int64 ids are read as they are.
  np.testing.assert_array_equal(
      lazy_optax.lookup(table, np.array([7, 0], np.int64)), [[14., 15.],
                                                             [0., 1.]])


# -- 3. clear errors ----------------------------------------------------------

def test_a_small_capacity_takes_the_default_probe():
  assert lazy_optax.IdTable(capacity=8).probe == 8
  assert lazy_optax.IdTable(capacity=100).probe == 16
  # One window of 8 slots: a round places one id there (the smallest).
  table = SMALL
  assert table.probe == 8
  slots, _, _ = table.assign(table.init(), np.array([12, 10]), step=0)
  assert np.asarray(slots).tolist() == [8, 0]


@pytest.mark.parametrize('kwargs, error, named', [
    (dict(capacity=0), ValueError, ['capacity must lie in']),
    (dict(capacity=0, probe=16), ValueError, ['capacity must lie in']),
    (dict(capacity=8, probe=9), ValueError,
     [r'probe \(with capacity=8\) must lie in \[1, 8\], got 9']),
    (dict(capacity=8, eviction='fifo', ttl=-1, rounds=0), ValueError,
     ['3 bad arguments', 'eviction must be one of', 'ttl must lie in',
      'rounds must lie in']),
    (dict(capacity=8.0, seed='x'), TypeError,
     ['2 bad arguments', 'capacity must be a Python int',
      'seed must be a Python int']),
    (dict(capacity=8, probe=True), TypeError,
     [r'probe \(with capacity=8\) must be a Python int']),
    (dict(capacity=8, lfu_period=0, sketch_depth=17, sketch_width=0,
          eviction_log=-1, admit_after=0), ValueError,
     ['admit_after', 'lfu_period', 'sketch_depth', 'sketch_width',
      'eviction_log']),
    (dict(capacity=8, checked='yes'), TypeError, ['checked must be a bool']),
])
def test_every_bad_table_argument_is_named(kwargs, error, named):
  with pytest.raises(error) as e:
    lazy_optax.IdTable(**kwargs)
  message = str(e.value)
  for part in named:
    assert re.search(part, message), (part, message)
  if kwargs.get('capacity') == 0:
    assert 'probe' not in message


@pytest.mark.parametrize('bad', [np.array([True, False]), jnp.array([True]),
                                 True, [False]])
def test_boolean_raw_ids_are_named_as_booleans(bad):
  for call in (lambda: TABLE.assign(TABLE.init(), bad, step=0),
               lambda: TABLE.find(TABLE.init(), bad),
               lambda: lazy_optax.split_ids(bad)):
    with pytest.raises(TypeError, match=r'booleans \(dtype bool\)') as e:
      call()
    assert 'Float' not in str(e.value)


@pytest.mark.parametrize('bad, error, match', [
    (np.array([1.0]), TypeError, 'split_ids: ids must have an integer dtype, '
     'got float64'),
    (np.array([4, -2], np.int64), ValueError,
     r'split_ids: ids must lie in \[0, 2\*\*63 - 1\], got -2 at flat position '
     '1'),
    (np.array([2 ** 63], np.uint64), ValueError, 'split_ids: ids must lie in'),
    ([2 ** 70], ValueError, 'split_ids: ids must be integers in'),
])
def test_bad_split_ids_arguments_are_named(bad, error, match):
  with pytest.raises(error, match=match):
    lazy_optax.split_ids(bad)
  with pytest.raises(TypeError, match='split_ids: ids_are_32bit must be a '
                     'bool'):
    lazy_optax.split_ids(np.array([1]), ids_are_32bit='no')


@pytest.mark.parametrize('rows', [6, 9])
def test_reset_rows_refuses_a_table_of_another_size_at_trace_time(rows):
  tx = lazy_optax.lazy_adam(0.1)
  table = SMALL                      # capacity 8, 2 ids: a shared trace
  words = lazy_optax.split_ids(np.array([100, 101]))

  def step(params, opt_state, id_state):
    _, id_state, fresh = table.assign(id_state, words, step=0)
    return lazy_optax.reset_rows(tx, params, opt_state, {'emb': fresh},
                                 init=None)

  # Traced, not compiled (eval_shape): the error comes at trace time.
  params = {'emb': jnp.ones((rows, 2))}
  with pytest.raises(ValueError, match=f'table emb has {rows} rows, but its '
                     'FreshRows come from an IdTable of capacity 8'):
    jax.eval_shape(step, params, tx.init(params), table.init())
  params = {'emb': jnp.ones((8, 2))}
  shapes = jax.eval_shape(step, params, tx.init(params), table.init())
  assert shapes[0]['emb'].shape == (8, 2)
  # The capacity is static data of FreshRows, kept through jit.
  fresh = jax.eval_shape(lambda s: table.assign(s, words, step=0)[2],
                         table.init())
  assert fresh.capacity == 8
  assert jax.tree.structure(fresh).num_leaves == 2
