//! Cutting this worker's part together with the job's other workers (`PartSource::Cut` with
//! `shuffle`): [`physalia_graph::chunked_shuffle`]'s all-to-alls over the job's mesh.

use anyhow::{Context, Result};
use physalia_control::PartCut;
use physalia_graph::chunked_shuffle::{Shuffle, ShuffleStats, cut_part_shuffled};
use physalia_graph::partition::Part;
use physalia_wire::{Link, Phase, Tag, WireError, all_to_all_bytes};

/// The mesh as a [`Shuffle`]: stage and round become the frames' layer and epoch under
/// [`Phase::Shuffle`]. A failed exchange is kept, so the caller can say the peer failed, not the data.
struct MeshShuffle<'a, L: Link + ?Sized> {
    link: &'a mut L,
    failed: Option<WireError>,
}

impl<L: Link + ?Sized> Shuffle for MeshShuffle<'_, L> {
    fn me(&self) -> usize {
        self.link.rank()
    }

    fn k(&self) -> usize {
        self.link.world()
    }

    fn all_to_all(
        &mut self,
        stage: u16,
        round: u32,
        out: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, physalia_graph::Error> {
        all_to_all_bytes(self.link, Tag::new(round, stage, Phase::Shuffle), out).map_err(|e| {
            let problem = format!("moving rows between the workers: {e}");
            self.failed = Some(e);
            physalia_graph::Error::Partition { problem }
        })
    }
}

/// Cuts part `c.part` (this worker's rank) with every other worker of the mesh and writes it to `c.out`.
/// A failure of the mesh (a peer lost or silent) is an exchange error, which the coordinator blames on
/// the peer; anything else (the dataset, the assignment) is this worker's.
pub fn cut_together<L: Link + ?Sized>(link: &mut L, c: &PartCut) -> Result<(Part, ShuffleStats)> {
    let mut mesh = MeshShuffle { link, failed: None };
    if mesh.me() != c.part {
        anyhow::bail!(
            "worker {} was asked to cut part {} with the other workers, which cuts the part of its rank",
            mesh.me(),
            c.part
        );
    }
    let cut = cut_part_shuffled(&c.dataset, &c.assignment, &c.out, &mut mesh);
    let context = || {
        format!(
            "cutting part {} of {} with the other workers",
            c.part,
            c.dataset.display()
        )
    };
    match (cut, mesh.failed) {
        (Ok(done), _) => Ok(done),
        (Err(_), Some(wire)) => Err(anyhow::Error::new(physalia_gnn::Error::Exchange(Box::new(
            wire,
        ))))
        .with_context(context),
        (Err(e), None) => Err(e).with_context(context),
    }
}
