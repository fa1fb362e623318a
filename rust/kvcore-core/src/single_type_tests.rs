//! Unit tests of the per-type rules (SPEC §10–15), with the spec's examples.

use super::*;
use crate::events::MetaRequest;

fn h(x: u8) -> BlockHash {
    BlockHash::from_slice(&[x; 32]).unwrap()
}

/// A pool of `n` blocks whose first `cached` blocks (ids 1..=cached) hold hashes 0..cached.
fn cached_pool(n: i64, cached: usize) -> (BlockPool, Vec<BlockHash>) {
    let mut p = BlockPool::new(n, true, 16, false).unwrap();
    let hashes: Vec<BlockHash> = (0..cached as u8).map(h).collect();
    let blocks = p.get_new_blocks(cached).unwrap();
    let mut get = |i: usize| -> Result<BlockHash, PoolError> { Ok(hashes[i]) };
    p.cache_full_blocks(
        &blocks,
        0,
        cached,
        16,
        0,
        None,
        HashSource {
            len: &mut || Ok(hashes.len()),
            get: &mut get,
        },
        &mut |_: &MetaRequest<'_>| Ok(StoredMeta::default()),
    )
    .unwrap();
    p.free_blocks(&blocks).unwrap();
    (p, hashes)
}

fn find(
    kind: Kind,
    p: &BlockPool,
    hashes: &[BlockHash],
    max_len: usize,
    drop: bool,
    alignment: usize,
) -> Result<HitBlocks, PoolError> {
    SingleTypeManager::find_longest_cache_hit(
        kind,
        p,
        HashView {
            hashes: &hashes,
            stride: 1,
        },
        max_len,
        &[0],
        16,
        drop,
        alignment,
        1,
    )
}

fn group(kind: Kind, sbs: usize, cap: Option<usize>) -> GroupConfig {
    GroupConfig {
        kind,
        spec_block_size: 16,
        dcp_world_size: 1,
        pcp_world_size: 1,
        group_id: 0,
        record_new_ids: false,
        admission_cap: cap,
        enable_caching: true,
        scheduler_block_size: sbs,
        max_model_len: 1024,
    }
}

/// SWA-3: the spec's examples (bs 16, w 32, hits everywhere but index 1, max 8 blocks).
#[test]
fn swa_3_lookup_examples() {
    let (mut p, hashes) = cached_pool(20, 9);
    p.evict_blocks(&[2]).unwrap();
    let swa = Kind::SlidingWindow { window: 32 };
    assert_eq!(
        find(swa, &p, &hashes, 128, false, 16).unwrap(),
        vec![vec![0, 0, 0, 0, 0, 0, 7, 8]]
    );
    assert_eq!(
        find(swa, &p, &hashes, 128, true, 16).unwrap(),
        vec![vec![0, 0, 0, 0, 0, 6, 7]]
    );
    assert_eq!(
        find(swa, &p, &hashes, 128, true, 32).unwrap(),
        vec![vec![0, 0, 0, 0, 5, 6]]
    );
    p.evict_blocks(&[3, 4, 5, 6, 7, 8]).unwrap();
    assert_eq!(
        find(swa, &p, &hashes, 128, false, 16).unwrap(),
        vec![vec![1]]
    );
    assert_eq!(
        find(swa, &p, &hashes, 128, false, 32).unwrap(),
        vec![Vec::<BlockId>::new()]
    );
}

/// SWA-4: only the tails of aligned segments are cached; None when all are reachable.
#[test]
fn swa_4_reachable_block_mask() {
    let swa = Kind::SlidingWindow { window: 32 };
    let m = |sbs: usize, eagle: bool| {
        let mut p = BlockPool::new(4, true, 16, false).unwrap();
        let mut m = SingleTypeManager::new(&mut p, group(swa, sbs, None)).unwrap();
        m.use_eagle = eagle;
        m
    };
    assert_eq!(
        m(32, false).reachable_block_mask(0, 8, None, 0).unwrap(),
        None
    );
    let (f, t) = (false, true);
    assert_eq!(
        m(64, false).reachable_block_mask(0, 8, None, 0).unwrap(),
        Some(vec![f, f, t, t, f, f, t, t])
    );
    assert_eq!(
        m(64, true).reachable_block_mask(0, 8, None, 0).unwrap(),
        Some(vec![f, f, t, t, t, f, t, t])
    );
    assert_eq!(
        m(64, false)
            .reachable_block_mask(0, 8, Some(0), 50)
            .unwrap(),
        Some(vec![f; 8])
    );
    assert_eq!(
        m(32, false)
            .reachable_block_mask(0, 8, Some(0), 100)
            .unwrap(),
        Some(vec![f, f, f, f, t, t, f, f])
    );
}

/// CLA-3's example (chunk 32, bs 16, max 100 tokens: six nulls) and CLA-2's skipping.
#[test]
fn cla_2_3_chunked_local() {
    let (p, hashes) = cached_pool(20, 7);
    let cla = Kind::ChunkedLocal { chunk: 32 };
    assert_eq!(
        find(cla, &p, &hashes, 100, false, 16).unwrap(),
        vec![vec![0; 6]]
    );
    assert_eq!(
        find(cla, &p, &hashes, 90, false, 16).unwrap(),
        vec![vec![0, 0, 0, 0, 5]]
    );
    assert!(matches!(
        find(cla, &p, &hashes, 90, true, 16),
        Err(PoolError::Invariant(_))
    ));
    assert!(matches!(
        find(cla, &p, &hashes, 90, false, 32),
        Err(PoolError::Invariant(_))
    ));
    let mut q = BlockPool::new(4, true, 16, false).unwrap();
    let m = SingleTypeManager::new(&mut q, group(cla, 16, Some(6))).unwrap();
    assert_eq!(m.get_num_skipped_tokens(70), 64);
    assert_eq!(m.admission_cap(), Some(6));
}

/// MAMBA-2: the last aligned hit, padded with nulls in front.
#[test]
fn mamba_2_last_aligned_hit() {
    let (mut p, hashes) = cached_pool(20, 5);
    let mamba = Kind::Mamba {
        mode: MambaMode::All,
        num_speculative_blocks: 0,
    };
    assert_eq!(
        find(mamba, &p, &hashes, 79, false, 16).unwrap(),
        vec![vec![0, 0, 0, 4]]
    );
    assert_eq!(
        find(mamba, &p, &hashes, 79, false, 32).unwrap(),
        vec![vec![0, 0, 0, 4]]
    );
    assert_eq!(
        find(mamba, &p, &hashes, 79, false, 48).unwrap(),
        vec![vec![0, 0, 3]]
    );
    p.evict_blocks(&[1, 2, 3, 4]).unwrap();
    assert_eq!(
        find(mamba, &p, &hashes, 79, false, 16).unwrap(),
        vec![Vec::<BlockId>::new()]
    );
}

/// FA-1 with EAGLE-1 and an alignment; XATTN-1's lookup is unsupported.
#[test]
fn fa_1_prefix_scan_eagle_and_alignment() {
    let (mut p, hashes) = cached_pool(20, 5);
    assert_eq!(
        find(Kind::Full, &p, &hashes, 80, false, 16).unwrap(),
        vec![vec![1, 2, 3, 4, 5]]
    );
    assert_eq!(
        find(Kind::Full, &p, &hashes, 80, true, 16).unwrap(),
        vec![vec![1, 2, 3, 4]]
    );
    assert_eq!(
        find(Kind::Full, &p, &hashes, 80, false, 32).unwrap(),
        vec![vec![1, 2, 3, 4]]
    );
    p.evict_blocks(&[3]).unwrap();
    assert_eq!(
        find(Kind::Full, &p, &hashes, 80, false, 16).unwrap(),
        vec![vec![1, 2]]
    );
    assert!(matches!(
        find(Kind::CrossAttention, &p, &hashes, 80, false, 16),
        Err(PoolError::Unsupported(_))
    ));
}

/// STM-4 pads skipped hits with nulls; STM-7/8 free back to front and stop at a null.
#[test]
fn stm_4_7_8_window_padding_and_removal() {
    let (mut p, _) = cached_pool(20, 6);
    let swa = Kind::SlidingWindow { window: 32 };
    let mut m = SingleTypeManager::new(&mut p, group(swa, 16, None)).unwrap();
    // 100 computed tokens: the first 69 are outside the window, 4 blocks are skipped.
    m.add_local_computed_blocks(&mut p, "b", &[1, 2, 3, 4, 5, 6], 96, 0)
        .unwrap();
    assert_eq!(m.blocks("b"), &[0, 0, 0, 0, 5, 6]);
    assert_eq!(p.ref_cnt(5), 1);
    m.allocate_new_blocks(&mut p, "b", 112, 112).unwrap();
    assert_eq!(m.blocks("b").len(), 7);
    m.remove_skipped_blocks(&mut p, "b", 112, None).unwrap();
    // 81 tokens before the window: blocks 0..5 go, back to front, stopping at the first null.
    assert_eq!(&m.blocks("b")[..6], &[0, 0, 0, 0, 0, 6]);
    assert_eq!(p.ref_cnt(5), 0);
    m.remove_skipped_blocks(&mut p, "zzz", 112, None).unwrap();
    assert!(
        m.tables.contains("zzz"),
        "the reference's default-dict read"
    );
    m.free(&mut p, "b", Retention::DEFAULT, 0.0).unwrap();
    m.check_invariants(&p).unwrap();
}

/// MAMBA-4/5 in align mode: a prefill takes 1 + ns blocks, later steps move the state block
/// and reuse the speculative ones, the count may be negative, free forgets the state.
#[test]
fn mamba_4_5_align_mode() {
    let mut p = BlockPool::new(30, true, 16, false).unwrap();
    let mamba = Kind::Mamba {
        mode: MambaMode::Align,
        num_speculative_blocks: 1,
    };
    let mut m = SingleTypeManager::new(&mut p, group(mamba, 16, None)).unwrap();
    let r = m.allocate_new_blocks(&mut p, "a", 40, 40).unwrap();
    assert_eq!(&m.blocks("a")[r], &[0, 0, 1, 2]);
    m.tables.entry("a").num_cached = Some(0);
    assert!(m
        .allocate_new_blocks(&mut p, "a", 48, 48)
        .unwrap()
        .is_empty());
    let r = m.allocate_new_blocks(&mut p, "a", 49, 49).unwrap();
    assert_eq!(m.blocks("a"), &[0, 0, 1, 2, 3]);
    assert_eq!(r, 4..5);
    assert_eq!(m.mamba.last_state_block_idx.get("a"), Some(&2));
    assert_eq!(
        m.get_num_blocks_to_allocate(&p, "a", 16, &[], 16, 16, false)
            .unwrap(),
        -3
    );
    m.remove_skipped_blocks(&mut p, "a", 80, None).unwrap();
    assert_eq!(m.blocks("a"), &[0, 0, 0, 0, 3]);
    m.free(&mut p, "a", Retention::DEFAULT, 0.0).unwrap();
    assert!(m.mamba.allocated.is_empty() && m.mamba.last_state_block_idx.is_empty());
    m.check_invariants(&p).unwrap();
}

/// SINK-1: the sink blocks leave the queue at construction; a bad sink length is refused.
#[test]
fn sink_1_reserves_blocks() {
    let mut p = BlockPool::new(10, true, 16, false).unwrap();
    let m = SingleTypeManager::new(&mut p, group(Kind::Sink { sink_len: 32 }, 16, None)).unwrap();
    assert_eq!(m.sink_blocks(), &[1, 2]);
    assert_eq!(p.get_num_free_blocks(), 7);
    for bad in [0, 24] {
        assert!(matches!(
            SingleTypeManager::new(&mut p, group(Kind::Sink { sink_len: bad }, 16, None)),
            Err(PoolError::Config(_))
        ));
    }
}
