//! Unit tests of the request-level manager (SPEC §8–9).

use super::*;
use crate::single_type::MambaMode;

fn h(x: u8) -> BlockHash {
    BlockHash::from_slice(&[x; 32]).unwrap()
}

fn req(id: &str, computed: usize, tokens: usize) -> RequestView<'_> {
    RequestView {
        id,
        num_computed_tokens: computed,
        num_tokens: tokens,
        num_prompt_tokens: tokens,
        waiting_or_preempted: true,
        hints: &[],
    }
}

fn group(kind: Kind, bs: usize, gid: u32, sbs: usize, caching: bool) -> GroupConfig {
    GroupConfig {
        kind,
        spec_block_size: bs,
        dcp_world_size: 1,
        pcp_world_size: 1,
        group_id: gid,
        record_new_ids: kind == Kind::Full,
        admission_cap: None,
        enable_caching: caching,
        scheduler_block_size: sbs,
        max_model_len: 1024,
    }
}

fn unitary(p: &mut BlockPool, max_model_len: usize, watermark: usize, eagle: bool) -> Coordinator {
    let caching = p.enable_caching();
    Coordinator::new(
        p,
        CoordinatorConfig {
            mode: if caching {
                Mode::Unitary
            } else {
                Mode::NoPrefixCache
            },
            groups: vec![group(
                Kind::Full,
                p.hash_block_size(),
                0,
                p.hash_block_size(),
                caching,
            )],
            eagle_groups: vec![eagle],
            attention_groups: Vec::new(),
            max_model_len,
            watermark_blocks: watermark,
            scheduler_block_size: p.hash_block_size(),
            retention_interval: None,
        },
    )
    .unwrap()
}

fn hybrid(p: &mut BlockPool) -> Coordinator {
    full_and(Kind::SlidingWindow { window: 32 }, p, 1024)
}

fn alloc(
    m: &mut Coordinator,
    p: &mut BlockPool,
    r: RequestView<'_>,
    args: AllocateArgs<'_>,
    hashes: &[BlockHash],
) -> Option<Vec<Vec<BlockId>>> {
    let mut get = |i: usize| -> Result<BlockHash, PoolError> { Ok(hashes[i]) };
    let ranges = m
        .allocate_slots(
            p,
            r,
            args,
            HashSource {
                len: &mut || Ok(hashes.len()),
                get: &mut get,
            },
            &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
        )
        .unwrap()?;
    Some(
        ranges
            .iter()
            .enumerate()
            .map(|(i, range)| m.groups[i].blocks(r.id)[range].to_vec())
            .collect(),
    )
}

fn new_tokens(n: usize) -> AllocateArgs<'static> {
    AllocateArgs {
        num_new_tokens: n,
        has_scheduled_reqs: true,
        ..Default::default()
    }
}

/// SPEC §19 S1: prefix reuse, the last token recomputed, free order, common prefix.
#[test]
fn scenario_s1_prefix_reuse_and_free_order() {
    let mut p = BlockPool::new(10, true, 16, true).unwrap();
    let mut m = unitary(&mut p, 1024, 0, false);
    let hashes = [h(1), h(2)];
    assert_eq!(
        alloc(&mut m, &mut p, req("r1", 0, 40), new_tokens(40), &hashes),
        Some(vec![vec![1, 2, 3]])
    );
    assert_eq!(m.take_new_block_ids(), vec![1, 2, 3]);
    m.free(&mut p, "r1", Retention::DEFAULT, 0.0).unwrap();
    assert_eq!(p.all_free_block_ids(), vec![3, 4, 5, 6, 7, 8, 9, 2, 1]);
    let (hit, n) = m.find_longest_cache_hit(&p, &&hashes[..], 39).unwrap();
    assert_eq!((hit.clone(), n), (vec![vec![1, 2]], 32));
    let a = AllocateArgs {
        num_new_tokens: 8,
        num_new_computed_tokens: 32,
        new_computed_blocks: Some(&hit),
        has_scheduled_reqs: true,
        ..Default::default()
    };
    assert_eq!(
        alloc(&mut m, &mut p, req("r2", 0, 40), a, &hashes),
        Some(vec![vec![3]])
    );
    assert_eq!(m.blocks("r2"), vec![&[1, 2, 3][..]]);
    // MGR-7: a fully cached 32-token prompt hits only 16.
    let (hit3, _) = m.find_longest_cache_hit(&p, &&hashes[..], 31).unwrap();
    assert_eq!(hit3, vec![vec![1]]);
    let a3 = AllocateArgs {
        num_new_tokens: 16,
        num_new_computed_tokens: 16,
        new_computed_blocks: Some(&hit3),
        has_scheduled_reqs: true,
        ..Default::default()
    };
    assert_eq!(
        alloc(&mut m, &mut p, req("r3", 0, 32), a3, &hashes),
        Some(vec![vec![4]])
    );
    assert_eq!(m.get_num_common_prefix_blocks(&p, "r2"), vec![1]);
    m.free(&mut p, "r2", Retention::DEFAULT, 0.0).unwrap();
    m.free(&mut p, "r3", Retention::DEFAULT, 0.0).unwrap();
    assert_eq!(p.all_free_block_ids(), vec![3, 5, 6, 7, 8, 9, 2, 4, 1]);
    m.check_invariants(&p).unwrap();
}

/// ALLOC-1 refuses zero tokens; a request that does not fit changes nothing.
#[test]
fn alloc_1_zero_tokens_rejected_and_capacity_none() {
    let mut p = BlockPool::new(5, false, 16, false).unwrap();
    let mut m = unitary(&mut p, 1024, 0, false);
    let mut get = |_: usize| -> Result<BlockHash, PoolError> { Ok(h(0)) };
    let r = m.allocate_slots(
        &mut p,
        req("x", 0, 10),
        AllocateArgs::default(),
        HashSource {
            len: &mut || Ok(0),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    );
    assert!(matches!(r, Err(PoolError::Invalid(_))));
    assert_eq!(
        alloc(&mut m, &mut p, req("x", 0, 100), new_tokens(100), &[]),
        None
    );
    assert_eq!(p.get_num_free_blocks(), 4);
    assert!(!m.groups[0].tables.contains("x"));
}

/// Fuzz find (`fuzz/seeds/manager/crash-allocate-slots-token-sum-overflow`): token counts near
/// `usize::MAX` neither overflow the sums nor wrap the fit test.
#[test]
fn allocate_slots_huge_counts_neither_panic_nor_wrap() {
    let fresh = || BlockPool::new(10, false, 16, false).unwrap();
    let mut p = fresh();
    let mut m = unitary(&mut p, 1024, 0, false);
    let a = AllocateArgs {
        num_new_tokens: 1,
        num_new_computed_tokens: 1,
        ..Default::default()
    };
    assert_eq!(
        alloc(&mut m, &mut p, req("x", usize::MAX, usize::MAX), a, &[]),
        None
    );
    let a = AllocateArgs {
        num_new_tokens: usize::MAX,
        num_lookahead_tokens: usize::MAX,
        num_external_computed_tokens: usize::MAX,
        ..Default::default()
    };
    let mut get = |_: usize| -> Result<BlockHash, PoolError> { Ok(h(0)) };
    let r = m.allocate_slots(
        &mut p,
        req("x", 5, usize::MAX),
        a,
        HashSource {
            len: &mut || Ok(0),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    );
    assert!(matches!(
        r,
        Ok(None) | Err(PoolError::NotEnoughFreeBlocks { .. })
    ));
    assert_eq!(p.get_num_free_blocks(), 9);
    let mut p = fresh();
    let mut m = unitary(&mut p, usize::MAX, 0, false);
    let a = AllocateArgs {
        num_new_tokens: 4,
        full_sequence_must_fit: true,
        ..Default::default()
    };
    assert_eq!(alloc(&mut m, &mut p, req("x", 0, usize::MAX), a, &[]), None);
    let mut m = unitary(&mut p, 1024, usize::MAX, false);
    assert_eq!(
        alloc(&mut m, &mut p, req("x", 0, 16), new_tokens(16), &[]),
        None
    );
    let mut m = unitary(&mut p, 1024, 0, false);
    let a = AllocateArgs {
        num_new_tokens: 16,
        reserved_blocks: i64::MIN,
        ..Default::default()
    };
    assert_eq!(
        alloc(&mut m, &mut p, req("x", 0, 32), a, &[]),
        Some(vec![vec![1]])
    );
    let a = AllocateArgs {
        num_new_tokens: 16,
        reserved_blocks: i64::MAX,
        ..Default::default()
    };
    assert_eq!(alloc(&mut m, &mut p, req("x", 16, 48), a, &[]), None);
    m.check_invariants(&p).unwrap();
}

/// MGR-26 clips by the spec's block size under context parallelism.
#[test]
fn mgr_26_counts_computed_tokens_in_the_spec_block_size() {
    let mut p = BlockPool::new(10, false, 32, false).unwrap();
    let mut g = group(Kind::Full, 16, 0, 32, false);
    g.dcp_world_size = 2;
    let mut m = Coordinator::new(
        &mut p,
        CoordinatorConfig {
            mode: Mode::NoPrefixCache,
            groups: vec![g],
            eagle_groups: vec![false],
            attention_groups: Vec::new(),
            max_model_len: 1024,
            watermark_blocks: 0,
            scheduler_block_size: 32,
            retention_interval: None,
        },
    )
    .unwrap();
    let got = alloc(&mut m, &mut p, req("x", 0, 150), new_tokens(150), &[]).unwrap();
    assert_eq!(got[0].len(), 5);
    assert_eq!(
        m.block_ids_for_computed_tokens("x", 28, &[true]),
        vec![&got[0][..2]]
    );
    assert_eq!(
        m.block_ids_for_computed_tokens("x", 75, &[true]),
        vec![&got[0][..5]]
    );
    assert_eq!(
        m.block_ids_for_computed_tokens("x", 75, &[false]),
        vec![&got[0][..]]
    );
}

/// TV-S4 (COORD-9/11, SWA-2 frees, MGR-20 order, SWA-3 hit) on the hybrid coordinator, and
/// the decode path's one lookup per group.
#[test]
fn hybrid_full_plus_sliding_window() {
    let mut p = BlockPool::new(30, true, 16, true).unwrap();
    let mut m = hybrid(&mut p);
    let hashes: Vec<BlockHash> = (0..7).map(h).collect();
    let got = alloc(&mut m, &mut p, req("r1", 0, 100), new_tokens(100), &hashes).unwrap();
    assert_eq!(got, vec![(1..8).collect::<Vec<_>>(), (8..15).collect()]);
    // A decode step past the window frees the sliding-window group's blocks behind it.
    let got = alloc(&mut m, &mut p, req("r1", 100, 113), new_tokens(13), &hashes).unwrap();
    assert_eq!(got, vec![vec![15], vec![16]]);
    assert_eq!(&m.blocks("r1")[1][..4], &[0, 0, 0, 0]);
    m.free(&mut p, "r1", Retention::DEFAULT, 0.0).unwrap();
    let (hit, n) = m.find_longest_cache_hit(&p, &&hashes[..], 99).unwrap();
    assert_eq!(n, 96);
    assert_eq!(hit[0], (1..7).collect::<Vec<_>>());
    assert_eq!(hit[1], vec![0, 0, 0, 0, 12, 13]);
    m.check_invariants(&p).unwrap();
}

/// A refused allocation with external tokens undoes ALLOC-6's frees (nothing changes).
#[test]
fn refused_external_allocation_changes_nothing() {
    let mut p = BlockPool::new(12, true, 16, false).unwrap();
    let mut m = hybrid(&mut p);
    let hashes: Vec<BlockHash> = (0..4).map(h).collect();
    let before = p.all_free_block_ids();
    let a = AllocateArgs {
        num_new_tokens: 16,
        num_external_computed_tokens: 2000,
        new_computed_blocks: Some(&[Vec::new(), Vec::new()]),
        ..Default::default()
    };
    let mut get = |i: usize| -> Result<BlockHash, PoolError> { Ok(hashes[i]) };
    let r = m.allocate_slots(
        &mut p,
        req("e", 0, 64),
        a,
        HashSource {
            len: &mut || Ok(hashes.len()),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    );
    assert!(r.is_err() || matches!(r, Ok(None)), "{r:?}");
    assert_eq!(p.all_free_block_ids(), before);
    m.check_invariants(&p).unwrap();
}

/// Mamba's align mode through the coordinator: a negative count is summed as the reference
/// sums it.
#[test]
fn mamba_align_counts_may_be_negative() {
    let mut p = BlockPool::new(30, true, 16, false).unwrap();
    let mamba = Kind::Mamba {
        mode: MambaMode::Align,
        num_speculative_blocks: 1,
    };
    let mut m = full_and(mamba, &mut p, 1024);
    let hashes: Vec<BlockHash> = (0..3).map(h).collect();
    let got = alloc(&mut m, &mut p, req("a", 0, 40), new_tokens(40), &hashes).unwrap();
    assert_eq!(got, vec![vec![1, 2, 3], vec![0, 0, 4, 5]]);
    let need = m
        .get_num_blocks_to_allocate(&p, "a", 16, None, 0, 16, 16, false)
        .unwrap();
    assert_eq!(need, -2);
    m.free(&mut p, "a", Retention::DEFAULT, 0.0).unwrap();
    m.check_invariants(&p).unwrap();
}

fn full_and(kind: Kind, p: &mut BlockPool, max_model_len: usize) -> Coordinator {
    full_and_sized(kind, p, max_model_len, 16)
}

/// A hybrid coordinator of a full-attention group and a `kind` group, both of `bs`-token
/// blocks (the scheduler block too).
fn full_and_sized(kind: Kind, p: &mut BlockPool, max_model_len: usize, bs: usize) -> Coordinator {
    full_and_blocks(kind, p, max_model_len, bs, bs)
}

/// A hybrid coordinator of a full-attention group of `full_bs`-token blocks (the scheduler
/// block too) and a `kind` group of `bs`-token blocks.
fn full_and_blocks(
    kind: Kind,
    p: &mut BlockPool,
    max_model_len: usize,
    full_bs: usize,
    bs: usize,
) -> Coordinator {
    Coordinator::new(
        p,
        CoordinatorConfig {
            mode: Mode::Hybrid,
            groups: vec![
                group(Kind::Full, full_bs, 0, full_bs, true),
                group(kind, bs, 1, full_bs, true),
            ],
            eagle_groups: vec![false, false],
            attention_groups: vec![
                AttentionGroup {
                    group_ids: vec![0],
                    use_eagle: false,
                    is_full: true,
                },
                AttentionGroup {
                    group_ids: vec![1],
                    use_eagle: false,
                    is_full: false,
                },
            ],
            max_model_len,
            watermark_blocks: 0,
            scheduler_block_size: full_bs,
            retention_interval: None,
        },
    )
    .unwrap()
}

fn try_alloc(
    m: &mut Coordinator,
    p: &mut BlockPool,
    r: RequestView<'_>,
    args: AllocateArgs<'_>,
) -> Result<Option<NewBlocks>, PoolError> {
    let mut get = |_: usize| -> Result<BlockHash, PoolError> { Ok(h(0)) };
    m.allocate_slots(
        p,
        r,
        args,
        HashSource {
            len: &mut || Ok(0),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    )
}

/// Fuzz finds (`fuzz/seeds/manager/crash-block-count-wrap`, `crash-two-group-sum-overflow`):
/// a block count above `i64::MAX` wrapped to a negative need that "fit", and the groups' sum
/// overflowed; counts now saturate, so the request is refused and nothing changes.
#[test]
fn huge_block_counts_saturate() {
    let mut p = BlockPool::new(10, false, 1, false).unwrap();
    let mut m = unitary(&mut p, usize::MAX, 0, false);
    let a = AllocateArgs {
        num_new_tokens: usize::MAX,
        ..Default::default()
    };
    assert_eq!(
        try_alloc(&mut m, &mut p, req("x", 0, usize::MAX), a),
        Ok(None)
    );
    assert!(!m.groups[0].tables.contains("x"));
    let mut p = BlockPool::new(10, true, 16, false).unwrap();
    let m = full_and(Kind::SlidingWindow { window: 32 }, &mut p, usize::MAX);
    let need = m
        .get_num_blocks_to_allocate(&p, "y", usize::MAX, None, 0, 0, usize::MAX, false)
        .unwrap();
    assert_eq!(need, 2 * usize::MAX.div_ceil(16) as i64);
}

/// Fuzz finds (`crash-mamba-align-huge-table`, `crash-window-padding-huge-table`): a token
/// count past `max_model_len` sized a table of nulls the memory cannot hold (an abort); such
/// tables are refused, and a Mamba group's count of zero main-model tokens no longer
/// underflows (`crash-mamba-align-zero-tokens`).
#[test]
fn tables_longer_than_a_sequence_are_refused() {
    let mut p = BlockPool::new(30, true, 16, false).unwrap();
    let mamba = Kind::Mamba {
        mode: MambaMode::Align,
        num_speculative_blocks: 1,
    };
    let mut m = full_and(mamba, &mut p, 256);
    let a = AllocateArgs {
        num_new_tokens: 1 << 40,
        delay_cache_blocks: true,
        ..Default::default()
    };
    let free = p.all_free_block_ids();
    assert!(matches!(
        try_alloc(&mut m, &mut p, req("a", 0, 1 << 40), a),
        Err(PoolError::Invalid(_)) | Ok(None)
    ));
    assert_eq!(p.all_free_block_ids(), free);
    let r = m.groups[1].allocate_new_blocks(&mut p, "z", 0, 0).unwrap();
    assert!(r.is_empty() || r.start <= r.end);
    let mut p = BlockPool::new(30, true, 16, false).unwrap();
    let mut g = full_and(Kind::SlidingWindow { window: 32 }, &mut p, usize::MAX);
    assert!(matches!(
        g.groups[1].add_local_computed_blocks(&mut p, "w", &[], usize::MAX, 0),
        Err(PoolError::Invalid(_))
    ));
    assert!(!g.groups[1].tables.contains("w"));
    // Saturated at the top (the exact count would be one more), without overflowing.
    assert_eq!(
        g.groups[1].get_num_skipped_tokens(usize::MAX),
        usize::MAX - 32
    );
}

/// Fuzz find (`crash-hit-id-out-of-range`): a hit id outside the pool was read (a panic);
/// it is refused before anything changes.
#[test]
fn hit_ids_outside_the_pool_are_refused() {
    let mut p = BlockPool::new(10, true, 16, false).unwrap();
    let mut m = unitary(&mut p, 1024, 0, false);
    let hits = [vec![999]];
    let a = AllocateArgs {
        num_new_tokens: 16,
        num_external_computed_tokens: 16,
        new_computed_blocks: Some(&hits),
        ..Default::default()
    };
    assert!(matches!(
        try_alloc(&mut m, &mut p, req("x", 0, 32), a),
        Err(PoolError::BlockOutOfRange { block_id: 999, .. })
    ));
    assert!(!m.groups[0].tables.contains("x"));
}

/// Fuzz find (`crash-negative-reserve`): a negative `reserved_blocks` let an allocation that
/// does not fit pass the capacity check and fail part-way; it reserves nothing now.
#[test]
fn a_negative_reservation_reserves_nothing() {
    let mut p = BlockPool::new(8, false, 16, false).unwrap();
    let mut m = unitary(&mut p, 1024, 0, false);
    let empty = [Vec::new()];
    let a = AllocateArgs {
        num_new_tokens: 320,
        new_computed_blocks: Some(&empty),
        reserved_blocks: -100,
        ..Default::default()
    };
    assert_eq!(try_alloc(&mut m, &mut p, req("x", 0, 320), a), Ok(None));
    assert!(!m.groups[0].tables.contains("x"));
    assert_eq!(p.get_num_free_blocks(), 7);
}

/// Fuzz find (`crash-huge-lookup-limit`): a lookup limit far past the request's hashes sized
/// the sliding-window search's buffer (an abort); the limit stops where the hashes end.
#[test]
fn huge_lookup_limits_stop_at_the_hashes() {
    let mut p = BlockPool::new(10, true, 16, false).unwrap();
    let m = full_and(Kind::SlidingWindow { window: 32 }, &mut p, 1024);
    let hashes = [h(1), h(2)];
    let (hit, lengths) = m
        .find_longest_cache_hit_per_group(&p, &&hashes[..], usize::MAX)
        .unwrap();
    assert_eq!((hit, lengths), (vec![vec![], vec![]], vec![0, 0]));
}

/// A running request's decode steps give the same blocks, tables and free queue on the
/// one-lookup running path as on the general path (taken here by `full_sequence_must_fit`,
/// which only adds a check that passes), for every group type the running path serves.
#[test]
fn running_path_matches_the_general_path() {
    let kinds = [
        Kind::SlidingWindow { window: 32 },
        Kind::ChunkedLocal { chunk: 32 },
        Kind::Mamba {
            mode: MambaMode::None,
            num_speculative_blocks: 0,
        },
        Kind::Mamba {
            mode: MambaMode::All,
            num_speculative_blocks: 1,
        },
        Kind::Mamba {
            mode: MambaMode::Align,
            num_speculative_blocks: 0,
        },
        Kind::Mamba {
            mode: MambaMode::Align,
            num_speculative_blocks: 2,
        },
    ];
    let hashes: Vec<BlockHash> = (1..=40).map(h).collect();
    // With caching off too: a request that never registers (ALLOC-8) takes the running path
    // in full-attention groups.
    let uncached = [Kind::Full, Kind::SlidingWindow { window: 32 }];
    let runs = kinds.into_iter().map(|k| (k, true));
    for (kind, caching) in runs.chain(uncached.into_iter().map(|k| (k, false))) {
        let mut sides: Vec<(BlockPool, Coordinator)> = (0..2)
            .map(|_| {
                let mut p = BlockPool::new(200, caching, 16, false).unwrap();
                let m = full_and(kind, &mut p, 1024);
                (p, m)
            })
            .collect();
        for (general, (p, m)) in sides.iter_mut().enumerate() {
            let args = AllocateArgs {
                full_sequence_must_fit: general == 1,
                ..new_tokens(40)
            };
            assert!(alloc(m, p, req("a", 0, 40), args, &hashes).is_some());
            m.new_step_starts();
        }
        for step in 0..80 {
            let computed = 40 + step;
            let lookahead = if step % 7 == 3 { 2 } else { 0 };
            let got: Vec<_> = sides
                .iter_mut()
                .enumerate()
                .map(|(general, (p, m))| {
                    let mut r = req("a", computed, computed + 1);
                    r.waiting_or_preempted = false;
                    r.num_prompt_tokens = 40;
                    let args = AllocateArgs {
                        full_sequence_must_fit: general == 1,
                        num_lookahead_tokens: lookahead,
                        ..new_tokens(1)
                    };
                    let new = alloc(m, p, r, args, &hashes);
                    m.new_step_starts();
                    let tables: Vec<Vec<BlockId>> =
                        (0..2).map(|g| m.groups[g].blocks("a").to_vec()).collect();
                    (new, tables, p.all_free_block_ids())
                })
                .collect();
            assert_eq!(got[0], got[1], "{kind:?} caching {caching} at step {step}");
        }
    }
}

/// Fuzz find (`crash-running-negative-reserve`): the running-request path took a negative
/// `reserved_blocks` as capacity, so a step that did not fit freed a window group's blocks and
/// then failed; both paths now share the one capacity rule and refuse it.
#[test]
fn a_negative_reservation_reserves_nothing_for_running_requests() {
    let mut p = BlockPool::new(12, true, 16, false).unwrap();
    let mut m = hybrid(&mut p);
    let hashes: Vec<BlockHash> = (0..8).map(h).collect();
    alloc(&mut m, &mut p, req("a", 0, 64), new_tokens(64), &hashes).unwrap();
    let mut r = req("a", 64, 65);
    r.waiting_or_preempted = false;
    let a = AllocateArgs {
        num_new_tokens: 1,
        num_lookahead_tokens: 160,
        reserved_blocks: -100,
        has_scheduled_reqs: true,
        ..Default::default()
    };
    let tables: Vec<Vec<BlockId>> = m.groups.iter().map(|g| g.blocks("a").to_vec()).collect();
    assert_eq!(try_alloc(&mut m, &mut p, r, a), Ok(None));
    // Only the window group's skipped blocks (ALLOC-6) may have become null.
    assert_eq!(m.groups[0].blocks("a"), &tables[0][..]);
    assert_eq!(m.groups[1].blocks("a").len(), tables[1].len());
    m.check_invariants(&p).unwrap();
}

/// Full attention, a 32-token window and `kind`, one attention group each.
fn full_window_and(kind: Kind, p: &mut BlockPool) -> Coordinator {
    let kinds = [Kind::Full, Kind::SlidingWindow { window: 32 }, kind];
    Coordinator::new(
        p,
        CoordinatorConfig {
            mode: Mode::Hybrid,
            groups: (0..3)
                .map(|i| group(kinds[i], 16, i as u32, 16, true))
                .collect(),
            eagle_groups: vec![false; 3],
            attention_groups: (0..3)
                .map(|i| AttentionGroup {
                    group_ids: vec![i],
                    use_eagle: false,
                    is_full: i == 0,
                })
                .collect(),
            max_model_len: 1024,
            watermark_blocks: 0,
            scheduler_block_size: 16,
            retention_interval: None,
        },
    )
    .unwrap()
}

/// Mamba align mode's count may be short of what the other groups take (it is negative when
/// the request holds more state blocks than the step needs): the capacity check then passes
/// and the allocation cannot be served. The reference fails part-way; kvcore refuses with
/// `NotEnoughFreeBlocks` and puts back what ALLOC-6 freed, on the running path too.
#[test]
fn a_short_mamba_count_changes_nothing_when_the_blocks_are_not_there() {
    let mamba = Kind::Mamba {
        mode: MambaMode::Align,
        num_speculative_blocks: 1,
    };
    let hashes: Vec<BlockHash> = (0..12).map(h).collect();
    let mut refused = 0;
    for pool_size in 8..30 {
        for computed in (0..=112).step_by(16).flat_map(|c| [c, c + 1]) {
            for look in (0..=160).step_by(16) {
                let mut p = BlockPool::new(pool_size, true, 16, false).unwrap();
                let mut m = full_window_and(mamba, &mut p);
                if alloc(&mut m, &mut p, req("a", 0, 200), new_tokens(128), &hashes).is_none() {
                    continue;
                }
                let tables: Vec<Vec<BlockId>> =
                    m.groups.iter().map(|g| g.blocks("a").to_vec()).collect();
                let free = p.all_free_block_ids();
                let mut r = req("a", computed, 200);
                r.waiting_or_preempted = false;
                let a = AllocateArgs {
                    num_new_tokens: 1,
                    num_lookahead_tokens: look,
                    delay_cache_blocks: true,
                    ..new_tokens(1)
                };
                let res = try_alloc(&mut m, &mut p, r, a);
                if let Err(e) = res {
                    assert!(matches!(e, PoolError::NotEnoughFreeBlocks { .. }), "{e:?}");
                    let now: Vec<Vec<BlockId>> =
                        m.groups.iter().map(|g| g.blocks("a").to_vec()).collect();
                    assert_eq!((now, p.all_free_block_ids()), (tables, free));
                    refused += 1;
                }
                m.check_invariants(&p).unwrap();
            }
        }
    }
    assert!(refused > 0);
}

/// Fuzz find (`crash-mamba-external-tokens`): external tokens for a new request in a model
/// with a Mamba group passed the capacity check (its count is short of its allocation) and
/// failed after the attention groups had allocated; the blocks every group takes are now
/// counted first, so the call refuses with `NotEnoughFreeBlocks` and nothing changes.
#[test]
fn external_tokens_with_a_mamba_group_refuse_before_allocating() {
    let mamba = Kind::Mamba {
        mode: MambaMode::Align,
        num_speculative_blocks: 2,
    };
    let mut refused = 0;
    for pool_size in 4..24 {
        for ext in [16usize, 17, 32, 48, 64] {
            let mut p = BlockPool::new(pool_size, true, 16, false).unwrap();
            let mut m = full_window_and(mamba, &mut p);
            let free = p.all_free_block_ids();
            let a = AllocateArgs {
                num_new_tokens: 16,
                num_external_computed_tokens: ext,
                delay_cache_blocks: true,
                ..new_tokens(16)
            };
            let r = req("x", 0, ext + 16);
            if let Err(e) = try_alloc(&mut m, &mut p, r, a) {
                assert!(matches!(e, PoolError::NotEnoughFreeBlocks { .. }), "{e:?}");
                assert_eq!(p.all_free_block_ids(), free);
                assert!(m.groups.iter().all(|g| g.blocks("x").is_empty()));
                refused += 1;
            }
            m.check_invariants(&p).unwrap();
        }
    }
    assert!(refused > 0);
}

/// Fuzz find (CI's 60-second `manager` run): on the running-request path two groups of
/// one-token blocks each wanting about `usize::MAX` blocks overflowed the sum of their new
/// blocks (a panic); it saturates now, so the step is refused and nothing changes.
#[test]
fn running_path_block_sum_saturates() {
    let mut p = BlockPool::new(10, true, 1, false).unwrap();
    let mut m = full_and_sized(Kind::SlidingWindow { window: 4 }, &mut p, usize::MAX, 1);
    let a = AllocateArgs {
        num_new_tokens: 2,
        new_computed_blocks: Some(&[Vec::new(), Vec::new()]),
        ..Default::default()
    };
    assert!(alloc(&mut m, &mut p, req("r", 0, 2), a, &[h(1), h(2)]).is_some());
    let free = p.all_free_block_ids();
    let running = RequestView {
        waiting_or_preempted: false,
        ..req("r", 2, usize::MAX)
    };
    let a = AllocateArgs {
        num_new_tokens: usize::MAX - 2,
        delay_cache_blocks: true,
        ..Default::default()
    };
    assert_eq!(try_alloc(&mut m, &mut p, running, a), Ok(None));
    assert_eq!(p.all_free_block_ids(), free);
    assert_eq!(m.groups[0].tables.get("r").map(|b| b.blocks.len()), Some(2));
}

/// `NewBlocks` keeps up to four 32-bit ranges inline and moves to the heap for a fifth group
/// or a bound past `u32::MAX`, with the same ranges and equality either way.
#[test]
fn new_blocks_spill_keeps_every_range() {
    let small: NewBlocks = (0..4).map(|i| i..i + 2).collect();
    assert!(matches!(small.0, Ranges::Inline { len: 4, .. }));
    assert_eq!(
        small.iter().collect::<Vec<_>>(),
        vec![0..2, 1..3, 2..4, 3..5]
    );
    let five: NewBlocks = (0..5).map(|i| i..i + 2).collect();
    assert!(matches!(five.0, Ranges::Heap(_)));
    assert_eq!(five.len(), 5);
    assert_eq!(five.get(4), Some(4..6));
    assert_eq!(five.get(5), None);
    let big = u32::MAX as usize + 7;
    let wide: NewBlocks = [0..1, big..big + 1].into_iter().collect();
    assert!(matches!(wide.0, Ranges::Heap(_)));
    assert_eq!(wide.iter().collect::<Vec<_>>(), vec![0..1, big..big + 1]);
    // Equal ranges are equal NewBlocks whatever holds them.
    let mut spilled = NewBlocks(Ranges::Heap(Vec::new()));
    spilled.push(0..1);
    assert_eq!(spilled, std::iter::once(0..1).collect::<NewBlocks>());
    assert_ne!(spilled, NewBlocks::default());
    assert!(NewBlocks::default().is_empty());
}

/// `allocate_is_noop` holds exactly for the running calls that allocate nothing and change
/// nothing: checked against `allocate_slots` itself over decode steps (with lookahead and
/// multi-token steps) in configurations without skipping groups (every skipping kind rules
/// no-ops out), caching on and off.
#[test]
fn a_noop_call_changes_nothing() {
    let hashes: Vec<BlockHash> = (1..=60).map(h).collect();
    // One group, and two full-attention groups under the hybrid rules (Hybrid's cache length).
    let kinds = [None, Some(Kind::Full)];
    for kind in kinds {
        for caching in [true, false] {
            let mut p = BlockPool::new(200, caching, 16, false).unwrap();
            let mut m = match kind {
                None => unitary(&mut p, 1024, 0, false),
                Some(k) => full_and(k, &mut p, 1024),
            };
            assert!(m.noop_possible());
            assert!(alloc(&mut m, &mut p, req("a", 0, 40), new_tokens(40), &hashes).is_some());
            m.new_step_starts();
            let (mut noops, mut others) = (0, 0);
            let mut computed = 40;
            for step in 0..120 {
                let n = if step % 11 == 5 { 3 } else { 1 };
                let lookahead = if step % 7 == 3 { 2 } else { 0 };
                let mut r = req("a", computed, computed + n);
                r.waiting_or_preempted = false;
                r.num_prompt_tokens = 40;
                let args = AllocateArgs {
                    num_lookahead_tokens: lookahead,
                    ..new_tokens(n)
                };
                let noop = m.allocate_is_noop(&p, &r, &args);
                // `num_tokens` only caps what the call caches: asked with a bound above the
                // count (unbounded, or a few tokens more) and the count read on demand, the
                // answer is the count's, and the count is read only when the bound's answer
                // would be no.
                let with =
                    |num_tokens| m.allocate_is_noop(&p, &RequestView { num_tokens, ..r }, &args);
                let unread = with(usize::MAX);
                for num_tokens in [computed, computed + n - 1, computed + n, computed + n + 4] {
                    let answer = with(num_tokens);
                    for bound in [usize::MAX, num_tokens, num_tokens + 3] {
                        let reads = std::cell::Cell::new(0);
                        let lazy = m.allocate_is_noop_reading(
                            &p,
                            &RequestView {
                                num_tokens: bound,
                                ..r
                            },
                            &args,
                            || {
                                reads.set(reads.get() + 1);
                                num_tokens
                            },
                        );
                        assert_eq!(
                            lazy, answer,
                            "{kind:?} step {step} num_tokens {num_tokens} bound {bound}"
                        );
                        if with(bound) {
                            assert_eq!(reads.get(), 0, "{kind:?} step {step}");
                        }
                    }
                    assert!(
                        !unread || answer,
                        "{kind:?} step {step} num_tokens {num_tokens}"
                    );
                }
                let groups = m.groups.len();
                let tables = |m: &Coordinator| -> Vec<Vec<BlockId>> {
                    (0..groups)
                        .map(|g| m.groups[g].blocks("a").to_vec())
                        .collect()
                };
                let state = |m: &Coordinator, p: &BlockPool| {
                    (tables(m), p.all_free_block_ids(), p.num_cached_keys())
                };
                let before = state(&m, &p);
                let new = alloc(&mut m, &mut p, r, args, &hashes).expect("fits");
                let after = state(&m, &p);
                if noop {
                    noops += 1;
                    assert!(new.iter().all(Vec::is_empty), "{kind:?} step {step}");
                    assert_eq!(before, after, "{kind:?} step {step}");
                } else {
                    others += 1;
                }
                m.new_step_starts();
                computed += n;
            }
            // Without caching the request never registers (no hits were passed: ALLOC-8), and
            // its full-attention calls are answered early all the same.
            assert!(
                noops > 60 && others > 5,
                "{kind:?} caching {caching}: {noops} noops, {others} others"
            );
        }
    }
    // A zero-token call is invalid, not a no-op; skipping groups rule no-ops out.
    let mut p = BlockPool::new(200, true, 16, false).unwrap();
    let mut m = unitary(&mut p, 1024, 0, false);
    assert!(alloc(&mut m, &mut p, req("a", 0, 40), new_tokens(40), &hashes).is_some());
    let mut r = req("a", 40, 41);
    r.waiting_or_preempted = false;
    assert!(!m.allocate_is_noop(&p, &r, &new_tokens(0)));
    for kind in [
        Kind::SlidingWindow { window: 32 },
        Kind::Mamba {
            mode: MambaMode::None,
            num_speculative_blocks: 0,
        },
    ] {
        let mut p = BlockPool::new(200, true, 16, false).unwrap();
        assert!(!full_and(kind, &mut p, 1024).noop_possible());
    }
}

/// Everything an `allocate_slots` that fails must leave as it was.
fn observable(
    m: &Coordinator,
    p: &BlockPool,
    id: &str,
) -> (Vec<Vec<BlockId>>, Vec<bool>, Vec<BlockId>) {
    (
        m.blocks(id).iter().map(|b| b.to_vec()).collect(),
        m.groups.iter().map(|g| g.tables.contains(id)).collect(),
        p.all_free_block_ids(),
    )
}

/// Fuzz find (manager target): hits refused by a later group (here: given with caching off)
/// used to leave the earlier groups' entries created; every group's refusal now comes first.
#[test]
fn hits_refused_in_a_later_group_change_nothing() {
    let mut p = BlockPool::new(10, false, 16, false).unwrap();
    let mut m = Coordinator::new(
        &mut p,
        CoordinatorConfig {
            mode: Mode::NoPrefixCache,
            groups: vec![
                group(Kind::Full, 16, 0, 16, false),
                group(Kind::Full, 16, 1, 16, false),
            ],
            eagle_groups: vec![false, false],
            attention_groups: Vec::new(),
            max_model_len: 1024,
            watermark_blocks: 0,
            scheduler_block_size: 16,
            retention_interval: None,
        },
    )
    .unwrap();
    let before = observable(&m, &p, "r");
    let hits = vec![vec![], vec![3]];
    let args = AllocateArgs {
        num_new_computed_tokens: 0,
        new_computed_blocks: Some(&hits),
        ..new_tokens(16)
    };
    let e = try_alloc(&mut m, &mut p, req("r", 0, 16), args).unwrap_err();
    assert!(matches!(e, PoolError::Invariant(_)), "{e}");
    assert_eq!(observable(&m, &p, "r"), before);
}

/// Fuzz find (manager target, every error checked): tokens to cache beyond `max_model_len`
/// (a request longer than the model allows) were found missing blocks only after the
/// allocation; the refusal now comes first.
#[test]
fn caching_beyond_the_allocation_is_refused_first() {
    let mut p = BlockPool::new(10, true, 16, false).unwrap();
    let mut m = unitary(&mut p, 48, 0, false);
    let hashes: Vec<BlockHash> = (0..29).map(h).collect();
    let before = observable(&m, &p, "r");
    let mut get = |i: usize| -> Result<BlockHash, PoolError> { Ok(hashes[i]) };
    let e = m
        .allocate_slots(
            &mut p,
            req("r", 0, 29 * 16),
            new_tokens(29 * 16),
            HashSource {
                len: &mut || Ok(hashes.len()),
                get: &mut get,
            },
            &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
        )
        .unwrap_err();
    assert!(matches!(e, PoolError::MissingBlocks(_)), "{e}");
    assert_eq!(observable(&m, &p, "r"), before);
}

/// Fuzz find (manager target): external tokens' blocks that fit one group but not the next
/// used to leave the first group's blocks taken; the count is checked first.
#[test]
fn external_blocks_that_do_not_fit_change_nothing() {
    let mut p = BlockPool::new(5, true, 16, false).unwrap();
    let mut m = full_and(Kind::Full, &mut p, 1024);
    let before = observable(&m, &p, "r");
    let e = m
        .allocate_new_computed_blocks(&mut p, "r", None, 0, 48)
        .unwrap_err();
    assert!(
        matches!(
            e,
            PoolError::NotEnoughFreeBlocks {
                requested: 6,
                free: 4
            }
        ),
        "{e}"
    );
    assert_eq!(observable(&m, &p, "r"), before);
    m.allocate_new_computed_blocks(&mut p, "r", None, 0, 32)
        .unwrap();
    assert_eq!(m.blocks("r"), vec![&[1, 2][..], &[3, 4][..]]);
}

/// Fuzz find (manager target): caching that a later group refuses (it holds too few blocks)
/// used to leave the earlier groups' blocks cached; every group's refusal comes first.
#[test]
fn caching_refused_by_a_later_group_changes_nothing() {
    let mut p = BlockPool::new(10, true, 16, false).unwrap();
    let mut m = full_and(Kind::Full, &mut p, 1024);
    m.groups[0]
        .allocate_new_blocks(&mut p, "r", 32, 32)
        .unwrap();
    let e = cache_32(&mut m, &mut p, |i| Ok(h(i as u8 + 1))).unwrap_err();
    assert!(matches!(e, PoolError::MissingBlocks(_)), "{e}");
    assert_eq!(p.num_cached_keys(), 0);
}

/// Caching reads every group's hashes (and event metadata) before storing any: a hash that
/// only a later group reads and that cannot be read leaves the earlier groups uncached.
#[test]
fn a_hash_a_later_group_cannot_read_caches_nothing() {
    let mut p = BlockPool::new(10, true, 16, true).unwrap();
    let mut m = full_and_blocks(Kind::SlidingWindow { window: 1024 }, &mut p, 1024, 32, 16);
    m.allocate_new_blocks(&mut p, "r", 32, 32, 0).unwrap();
    // The full group (32-token blocks) reads hash 1 only; the window group reads 0 and 1.
    let e = cache_32(&mut m, &mut p, |i| {
        if i == 0 {
            Err(PoolError::Invalid("unreadable hash".into()))
        } else {
            Ok(h(2))
        }
    })
    .unwrap_err();
    assert!(matches!(e, PoolError::Invalid(_)), "{e}");
    assert_eq!(p.num_cached_keys(), 0);
    assert!(!p.has_pending_events());
    assert!(m
        .groups
        .iter()
        .all(|g| g.tables.get("r").unwrap().num_cached.is_none()));
}

/// `cache_blocks` of request "r" (32 tokens) over two hashes read by `get`.
fn cache_32(
    m: &mut Coordinator,
    p: &mut BlockPool,
    mut get: impl FnMut(usize) -> Result<BlockHash, PoolError>,
) -> Result<(), PoolError> {
    m.cache_blocks(
        p,
        &req("r", 32, 32),
        32,
        HashSource {
            len: &mut || Ok(2),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    )
}
