"""BatchIterator: per-epoch shuffling, exact resume, disjoint host shards."""

import json

import pytest

from agentrl_jax.data import BatchIterator, TaskRecord


def make_records(n):
    return [TaskRecord(prompt=f"q{i}", answer=str(i), id=str(i)) for i in range(n)]


def ids(batch):
    return [r.id for r in batch]


def test_epochs_are_permutations_with_different_orders():
    records = make_records(12)
    it = BatchIterator(records, batch_size=4, seed=7)
    epochs = [[i for _ in range(3) for i in ids(next(it))] for _ in range(3)]
    for epoch in epochs:
        assert sorted(epoch, key=int) == [str(i) for i in range(12)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != [str(i) for i in range(12)]
    assert it.epoch == pytest.approx(3.0)
    assert all(isinstance(b, list) for b in [next(it)])  # lists of records, not collated arrays


def test_same_seed_same_order_other_seed_differs():
    first = [ids(b) for b, _ in zip(BatchIterator(make_records(10), batch_size=3, seed=1), range(8))]
    again = [ids(b) for b, _ in zip(BatchIterator(make_records(10), batch_size=3, seed=1), range(8))]
    other = [ids(b) for b, _ in zip(BatchIterator(make_records(10), batch_size=3, seed=2), range(8))]
    assert first == again and first != other


def test_resume_continues_with_exactly_the_next_batch():
    records = make_records(10)
    reference = BatchIterator(records, batch_size=3, seed=5)
    expected = [ids(next(reference)) for _ in range(12)]  # crosses several epoch boundaries
    it = BatchIterator(records, batch_size=3, seed=5)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # the checkpoint stores it as JSON
    resumed = BatchIterator(records, batch_size=3, seed=5)
    resumed.set_state(state)
    assert resumed.batches_served == 5
    assert [ids(next(resumed)) for _ in range(7)] == expected[5:]


def test_resume_into_a_different_setup_is_an_error():
    it = BatchIterator(make_records(10), batch_size=3, seed=5)
    next(it)
    state = it.get_state()
    with pytest.raises(ValueError, match="seed: saved 5 vs now 6"):
        BatchIterator(make_records(10), batch_size=3, seed=6).set_state(state)
    with pytest.raises(ValueError, match="num_records"):
        BatchIterator(make_records(11), batch_size=3, seed=5).set_state(state)


def test_host_shards_are_disjoint_and_union_is_the_global_batch():
    records = make_records(16)
    single = BatchIterator(records, batch_size=8, seed=3)
    hosts = [BatchIterator(records, batch_size=2, seed=3, shard_index=h, shard_count=4) for h in range(4)]
    for _ in range(6):
        global_batch = ids(next(single))
        host_batches = [ids(next(h)) for h in hosts]
        flat = [i for b in host_batches for i in b]
        assert all(len(b) == 2 for b in host_batches)
        assert len(set(flat)) == 8
        assert sorted(flat) == sorted(global_batch)


def test_finite_unshuffled_epoch_for_evaluation():
    it = BatchIterator(make_records(7), batch_size=3, shuffle=False, num_epochs=1, drop_remainder=False)
    assert [ids(b) for b in it] == [["0", "1", "2"], ["3", "4", "5"], ["6"]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="cannot fill one global batch"):
        BatchIterator(make_records(5), batch_size=3, shard_count=2)
    with pytest.raises(ValueError, match="shard_index"):
        BatchIterator(make_records(5), batch_size=1, shard_index=2, shard_count=2)


def test_a_state_resumes_on_another_number_of_hosts():
    """Two hosts' checkpoint resumes on one host and on four, at the same next global batch."""
    records = make_records(24)
    single = BatchIterator(records, batch_size=4, seed=3)
    expected = [ids(next(single)) for _ in range(9)]
    two = [BatchIterator(records, batch_size=2, seed=3, shard_index=h, shard_count=2) for h in range(2)]
    for _ in range(5):
        for it in two:
            next(it)
    state = json.loads(json.dumps(two[0].get_state()))  # the checkpoint keeps process 0's
    one = BatchIterator(records, batch_size=4, seed=3)
    one.set_state(state)
    assert [ids(next(one)) for _ in range(4)] == expected[5:]
    four = [BatchIterator(records, batch_size=1, seed=3, shard_index=h, shard_count=4) for h in range(4)]
    for it in four:
        it.set_state(state)
    dealt = [[ids(next(it))[0] for it in four] for _ in range(4)]
    assert [sorted(b, key=int) for b in dealt] == [sorted(b, key=int) for b in expected[5:]]
    with pytest.raises(ValueError, match="global_batch_size: saved 4 vs now 6"):
        BatchIterator(records, batch_size=3, seed=3, shard_index=0, shard_count=2).set_state(state)
