from nccl_ext.core.groups import GroupRegistry, group_key


def test_non_member_groups_are_never_materialised():
    reg = GroupRegistry(rank=5, world_size=8192)
    for start in range(0, 8192, 8):
        reg.make(tuple(range(start, start + 8)))
    assert reg.created == 1024
    assert reg.materialised == 1


def test_key_is_shared_by_members_and_counts_repeats():
    a, b = GroupRegistry(rank=0, world_size=4), GroupRegistry(rank=2, world_size=4)
    # rank 2 does not see the non-member group [1, 3] (use_local_synchronization) — keys still agree
    a_keys = [a.make((0, 2)).key, a.make((0, 2)).key]
    b.make((1, 3))
    b_keys = [b.make((0, 2)).key, b.make((0, 2)).key]
    assert a_keys == b_keys
    assert a_keys[0] != a_keys[1]
    assert a_keys[0] == group_key((0, 2), 0)


def test_group_rank_lookup():
    info = GroupRegistry(rank=6, world_size=8).make((2, 6, 7))
    assert info.group_rank(6) == 1 and info.size == 3
