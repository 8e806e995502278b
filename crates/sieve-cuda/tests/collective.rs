//! NCCL collectives ([`sieve_cuda::collective`]) on every GPU of the machine (at most
//! `SIEVE_TP_WORLD`, default all): out-of-place all-reduce and all-gather give the sums and the
//! concatenation exactly (small integers in f32), eagerly and as CUDA graph replays after the
//! inputs changed. At world size 1 (NCCL communicators all the same) each is a copy into a
//! NaN-poisoned output, so a call that did nothing still fails. Without a GPU or NCCL the test prints why and passes, unless
//! `SIEVE_REQUIRE_GPU=1`.

use sieve_cuda::collective::{self, group_end, group_start, nccl_available, open_nccl_ranks, Rank};
use sieve_cuda::graph::StepGraph;
use sieve_cuda::{dev_ptr, gpu_or_skip};

const LEN: usize = 4096 + 3;

/// Rank r's input: value i of round `round`.
fn input(r: usize, round: usize) -> Vec<f32> {
    (0..LEN)
        .map(|i| ((i % 97) as f32) + 1000.0 * r as f32 + 7.0 * round as f32)
        .collect()
}

fn sum_over_ranks(world: usize, round: usize) -> Vec<f32> {
    (0..LEN)
        .map(|i| (0..world).map(|r| input(r, round)[i]).sum())
        .collect()
}

fn ranks_or_skip(test: &str) -> Option<Vec<Rank>> {
    gpu_or_skip(test)?;
    let require = std::env::var("SIEVE_REQUIRE_GPU").as_deref() == Ok("1");
    if !nccl_available() {
        assert!(
            !require,
            "{test}: SIEVE_REQUIRE_GPU=1 but NCCL did not load"
        );
        eprintln!("{test}: skipped, no NCCL (libnccl.so)");
        return None;
    }
    let count = sieve_cuda::gpu::device_count().unwrap();
    let world = std::env::var("SIEVE_TP_WORLD")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(count)
        .clamp(1, count);
    eprintln!(
        "{test}: NCCL {} over {world} of {count} GPU(s)",
        collective::nccl_version().unwrap()
    );
    Some(open_nccl_ranks(world).unwrap())
}

#[test]
fn all_reduce_and_all_gather_match_the_host_eagerly_and_in_graphs() {
    let test = "all_reduce_and_all_gather_match_the_host_eagerly_and_in_graphs";
    let Some(ranks) = ranks_or_skip(test) else {
        return;
    };
    let world = ranks.len();
    let mut sends: Vec<_> = ranks
        .iter()
        .map(|k| k.gpu.upload(&input(k.comm.rank(), 0)).unwrap())
        .collect();
    let mut sums: Vec<_> = ranks
        .iter()
        .map(|k| k.gpu.upload(&vec![f32::NAN; LEN]).unwrap())
        .collect();
    let mut gathered: Vec<_> = ranks
        .iter()
        .map(|k| k.gpu.upload(&vec![f32::NAN; world * LEN]).unwrap())
        .collect();
    let ptrs = |bufs: &[cudarc::driver::CudaSlice<f32>]| -> Vec<u64> {
        bufs.iter()
            .zip(&ranks)
            .map(|(b, k)| dev_ptr(&k.gpu, b))
            .collect()
    };
    let (send_at, sum_at, gather_at) = (ptrs(&sends), ptrs(&sums), ptrs(&gathered));
    // One thread drives every rank: each collective's calls go in one group.
    let enqueue = |ranks: &[Rank]| {
        group_start().unwrap();
        for (r, k) in ranks.iter().enumerate() {
            // SAFETY: every buffer lives on rank r's GPU with the lengths given.
            unsafe {
                k.comm
                    .all_reduce_sum_f32(&k.gpu, send_at[r], sum_at[r], LEN)
            }
            .unwrap();
        }
        group_end().unwrap();
        group_start().unwrap();
        for (r, k) in ranks.iter().enumerate() {
            // SAFETY: as above; `gathered` holds world * LEN.
            unsafe { k.comm.all_gather_f32(&k.gpu, send_at[r], gather_at[r], LEN) }.unwrap();
        }
        group_end().unwrap();
    };
    type Bufs = [cudarc::driver::CudaSlice<f32>];
    let check = |round: usize, how: &str, sums: &Bufs, gathered: &Bufs| {
        let want = sum_over_ranks(world, round);
        for (r, k) in ranks.iter().enumerate() {
            k.gpu.synchronize().unwrap();
            let got = k.gpu.download(&sums[r]).unwrap();
            assert_eq!(got, want, "{how}: all-reduce on rank {r}");
            let got = k.gpu.download(&gathered[r]).unwrap();
            for q in 0..world {
                assert_eq!(
                    got[q * LEN..(q + 1) * LEN],
                    input(q, round)[..],
                    "{how}: all-gather on rank {r}, part of rank {q}"
                );
            }
        }
    };
    enqueue(&ranks);
    check(0, "eager", &sums, &gathered);

    // The same calls captured on every rank's stream, replayed after new inputs.
    for k in &ranks {
        StepGraph::begin_capture(k.gpu.stream()).unwrap();
    }
    enqueue(&ranks);
    let graphs: Vec<StepGraph> = ranks
        .iter()
        .map(|k| StepGraph::end_capture(k.gpu.stream(), false).unwrap())
        .collect();
    for round in 1..3 {
        for (r, k) in ranks.iter().enumerate() {
            k.gpu.synchronize().unwrap();
            let stream = k.gpu.stream();
            stream.memcpy_htod(&input(r, round), &mut sends[r]).unwrap();
            // Poison the outputs, so that a replay that wrote nothing fails.
            stream
                .memcpy_htod(&vec![f32::NAN; LEN], &mut sums[r])
                .unwrap();
            stream
                .memcpy_htod(&vec![f32::NAN; world * LEN], &mut gathered[r])
                .unwrap();
            k.gpu.synchronize().unwrap();
        }
        for g in &graphs {
            g.launch().unwrap();
        }
        check(round, &format!("graph replay {round}"), &sums, &gathered);
    }
}
