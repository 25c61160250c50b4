"""python -m lazy_optax.demo: its model, its table and its error messages."""

import io

import fork_server
import jax.numpy as jnp
import numpy as np
import pytest

from lazy_optax import demo

_PRELOADED = ('numpy', 'jax', 'jax.numpy', 'optax', 'lazy_optax')

TEXT = ('the quick brown fox jumps over the lazy dog and the dog sleeps '
        'while the fox runs to the river bank near the old mill ') * 40


def _numpy_loss(p_in, p_out, center, context, negatives):
  log_sigmoid = lambda x: -np.log1p(np.exp(-x))
  u = p_in[center]
  pos = log_sigmoid(np.sum(u * p_out[context], -1))
  neg = log_sigmoid(-np.einsum('bd,bkd->bk', u, p_out[negatives])).sum(-1)
  return -np.mean(pos + neg)


def test_loss_matches_a_numpy_model():
  rng = np.random.default_rng(0)
  p_in, p_out = rng.normal(size=(2, 20, 3)) * 0.5
  center, context = rng.integers(0, 20, (2, 6))
  negatives = rng.integers(0, 20, (6, 4))
  got = demo.skipgram_loss(
      {'in': jnp.asarray(p_in, jnp.float32),
       'out': jnp.asarray(p_out, jnp.float32)},
      jnp.asarray(center), jnp.asarray(context), jnp.asarray(negatives))
  np.testing.assert_allclose(
      got, _numpy_loss(p_in, p_out, center, context, negatives), rtol=1e-5)


def test_skipgram_pairs_are_the_window_neighbours():
  centers, contexts, vocab = demo.skipgram_pairs('a b c a', 5, window=2)
  assert vocab == 3
  pairs = sorted(zip(centers.tolist(), contexts.tolist()))
  # ids: a=0 b=1 c=2; text 0 1 2 0; neighbours within two words.
  expected = sorted([(0, 1), (1, 0), (1, 2), (2, 1), (2, 0), (0, 2),
                     (0, 2), (2, 0), (1, 0), (0, 1)])
  assert pairs == expected


def test_demo_trains_both_and_prints_the_table(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_text(TEXT, encoding='utf-8')
  out, bar = io.StringIO(), io.StringIO()
  results = demo.main(['--steps', '40', '--table-rows', '3000', '--dim', '8',
                       '--batch', '64', '--lr', '0.05', '--text', str(path)],
                      stream=out, progress=bar)
  text = out.getvalue()
  assert 'lazy_adam' in text and 'optax.adam' in text
  assert 'speed-up of lazy_adam over optax.adam' in text
  assert '2 x 3,000 rows x 8 float32' in text
  assert 'corpus.txt: 18 distinct words' in text
  assert '40/40' in bar.getvalue() and '#' * 30 in bar.getvalue()
  start = np.log(2) * 5   # loss at zero output vectors: 5 log 2
  for name in ('lazy_adam', 'optax.adam'):
    assert 0 < results[name]['loss'] < 0.8 * start, results
    assert results[name]['step_ms'] > 0


@pytest.mark.parametrize('argv, message', [
    (['--steps', '0'], '--steps must be positive'),
    (['--dim', 'x'], '--dim must be a whole number'),
    (['--batch', '-3'], '--batch must be positive'),
    (['--lr', '0'], 'learning rate must be positive'),
    (['--lr', 'nan'], 'learning rate must be positive'),
    (['--table-rows', '5'], 'smaller than the vocabulary'),
    (['--table-rows', '100000000', '--dim', '64'], 'over 2 GiB'),
])
def test_bad_options_are_named(argv, message, capsys, tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_text(TEXT, encoding='utf-8')
  with pytest.raises(SystemExit) as e:
    demo.parse_args(argv + ['--text', str(path)])
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_unreadable_files_are_named(capsys, tmp_path):
  binary = tmp_path / 'binary.txt'
  binary.write_bytes(b'\xff\xfe\x00bad')
  empty = tmp_path / 'empty.txt'
  empty.write_text('1234 !!', encoding='utf-8')
  for path, message in ((tmp_path / 'missing.txt', 'No such file'),
                        (tmp_path, 'cannot read --text'),
                        (binary, 'not UTF-8'),
                        (empty, 'at least two')):
    with pytest.raises(SystemExit):
      demo.parse_args(['--text', str(path)])
    err = capsys.readouterr().err
    assert message in err, err
    assert str(path.name) in err


def test_command_line_entry_point(tmp_path):
  path = tmp_path / 'corpus.txt'
  path.write_text(TEXT, encoding='utf-8')
  argv = ['--steps', '3', '--table-rows', '1000', '--dim', '4', '--batch',
          '16', '--text', str(path)]
  # `python -m lazy_optax.demo ARGS` as runpy runs it, in a fresh process: a
  # forked child of the one-device process that imported jax and lazy_optax
  # once (tests/fork_server.py; the preloaded modules of
  # tests/test_kernel_cache.py's, so one server serves both).
  code = ('import runpy, sys\n'
          f'sys.argv = [\'lazy_optax.demo\', *{argv!r}]\n'
          "runpy.run_module('lazy_optax.demo', run_name='__main__', "
          'alter_sys=True)\n')
  (proc,) = fork_server.run_scripts([code], {}, preloaded=_PRELOADED)
  assert proc.returncode == 0, proc.stderr
  assert 'speed-up of lazy_adam over optax.adam' in proc.stdout
  assert '3/3' in proc.stderr
