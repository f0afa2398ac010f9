//! The prefix cache's lower levels: entries evicted from the KV cache kept as branch
//! snapshots (`Branch::snapshot`: KV cells, tokens, sampler state, sealed with the model's
//! identity and a checksum) in host memory, and from there on disk, least recently used
//! first at each level. A prompt that matches a spilled entry gets it back by
//! `Branch::restore` (a copy into the cache: ~170× faster than prefilling the same tokens
//! on a CPU, BENCHMARKS §18) instead of prefilling it.
//!
//! An entry is the snapshot followed by the branch's recurrent-state checkpoints (`pack`; none
//! on attention-only models): on a recurrent or hybrid model a prompt that parts from the
//! entry inside it restores up to the last checkpoint before that point, where the state is
//! known, instead of prefilling everything.
//!
//! An entry that shared its first tokens with another branch of the cache (a common preamble)
//! and is evicted while that prefix is still in the KV is spilled with its own cells only, the
//! ones after that *anchor*: restoring it takes the anchor's cells from whoever holds them then
//! (`seq_cp`, no copy). While nobody does, the spilled entry that holds them (if any) comes
//! back instead, and the rest is prefilled.
//!
//! On disk each entry is one file, `<id>.kvfe`: a header (magic, version, the tokens, so
//! a restart rebuilds the index without reading the KV) and the entry. `Spill` is only the
//! index and the host level: it hands out the files to write (`take_writes`) and to read
//! (`Taking::read`), which the prefix cache does outside its lock, so that requests are not
//! held up by a disk while an entry goes to it or comes back. An entry being written counts
//! on disk and is still served from memory. Files are written
//! under a temporary name and renamed, so a crash leaves either a whole file or a `.tmp`
//! that the next start removes; a file that does not parse is skipped (and removed), one
//! from another model or cache layout is refused by the snapshot's own checks when it is
//! restored (and removed then).

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvfork_core::prefix_trie::PrefixTrie;

use crate::error::{Error, Result};
use crate::model::Token;

const MAGIC: &[u8; 4] = b"KVFE";
/// 4: the checkpoints follow the snapshot, the anchor precedes its length.
const VERSION: u32 = 4;
const EXTENSION: &str = "kvfe";
/// A `.tmp` file older than this is what a crash cut short (a write takes seconds at most);
/// a newer one may be another cache's write under way on the same directory.
const STALE_WRITE: std::time::Duration = std::time::Duration::from_secs(600);

/// Where spilled entries go and how much each level holds.
#[derive(Debug, Clone, Default)]
pub struct SpillConfig {
    /// Bytes of snapshots kept in host memory (0: none).
    pub host_bytes: usize,
    /// A directory for snapshots host memory cannot hold (kept across restarts).
    pub disk_dir: Option<PathBuf>,
    /// Bytes of snapshots kept on disk.
    pub disk_bytes: usize,
}

impl SpillConfig {
    /// Whether evicted entries are kept anywhere.
    pub fn spills(&self) -> bool {
        self.host_bytes > 0 || (self.disk_dir.is_some() && self.disk_bytes > 0)
    }
}

/// Counts of one level.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LevelStats {
    /// Entries held now.
    pub entries: usize,
    /// Their bytes.
    pub bytes: usize,
    /// Entries brought back into the KV cache from this level.
    pub hits: u64,
    /// Prompt tokens those entries held (restored instead of prefilled).
    pub restored_tokens: u64,
}

enum Place {
    Host(Arc<Vec<u8>>),
    /// Going to disk (a `DiskWrite` handed out): counted there, still read from memory.
    Writing(Arc<Vec<u8>>),
    Disk(PathBuf),
}

impl Place {
    fn on_disk(&self) -> bool {
        !matches!(self, Place::Host(_))
    }
}

struct Entry {
    tokens: Vec<Token>,
    /// Its first cells are not in its snapshot: another branch's (0: none).
    anchor: usize,
    bytes: usize,
    place: Place,
}

/// The spilled entries of one prefix cache.
pub(crate) struct Spill {
    config: SpillConfig,
    /// The context's model and cache element types, as one key: a file written under another
    /// is not this cache's (its cells would not load), and is left alone.
    layout: u64,
    trie: PrefixTrie<u64>,
    entries: HashMap<u64, Entry>,
    next_id: u64,
    host: LevelStats,
    disk: LevelStats,
    /// Files to write, handed out by `take_writes`.
    writes: Vec<DiskWrite>,
}

/// An entry's file to write, outside the cache's lock; then `Spill::written`.
pub(crate) struct DiskWrite {
    id: u64,
    path: PathBuf,
    layout: u64,
    anchor: usize,
    tokens: Vec<Token>,
    entry: Arc<Vec<u8>>,
}

impl DiskWrite {
    /// Write the file (under a temporary name, then renamed).
    pub fn run(&self) -> std::io::Result<()> {
        write_file(
            &self.path,
            self.layout,
            self.anchor,
            &self.tokens,
            &self.entry,
        )
    }
}

/// A spilled entry taken out of its level, to read (outside the cache's lock) and restore.
pub(crate) struct Taking {
    id: u64,
    tokens: Vec<Token>,
    anchor: usize,
    /// The cache's layout: with the anchor and tokens, the header its file must begin with.
    layout: u64,
    /// Where it was.
    place: Place,
}

impl Taking {
    /// The entry's bytes: from memory (an entry still being written too), or read from its
    /// file (which stays: `Spill::settle`). A file that is not the entry it was indexed as is
    /// an error: the caller drops the entry (`Spill::drop_entry`).
    pub fn read(self) -> Result<Taken> {
        let from_disk = self.place.on_disk();
        let (entry, file) = match self.place {
            Place::Host(entry) | Place::Writing(entry) => (entry, None),
            Place::Disk(path) => {
                let header = header(self.layout, self.anchor, &self.tokens);
                let body = match fs::read(&path) {
                    Err(e) => Err(Error::io(&path, e)),
                    Ok(file) if file.len() < header.len() => {
                        Err(Error::State(format!("{} is truncated", path.display())))
                    }
                    // Rewritten since it was indexed (another process on the same directory):
                    // its cells are another prompt's.
                    Ok(file) if file[..header.len()] != header[..] => Err(Error::State(format!(
                        "{} no longer holds the tokens it was written with",
                        path.display()
                    ))),
                    Ok(file) => Ok(file[header.len()..].to_vec()),
                };
                (Arc::new(body?), Some(path))
            }
        };
        Ok(Taken {
            id: self.id,
            entry,
            tokens: self.tokens,
            anchor: self.anchor,
            from_disk,
            file,
        })
    }
}

/// A spilled entry taken out to be restored, then settled (`Spill::settle`).
pub(crate) struct Taken {
    id: u64,
    /// A `Branch::snapshot` and its checkpoints (`pack`).
    pub entry: Arc<Vec<u8>>,
    /// The tokens it holds.
    pub tokens: Vec<Token>,
    anchor: usize,
    /// Whether it was on disk (else in host memory).
    pub from_disk: bool,
    /// Its file, when it was read from one (not when it was still being written): the entry
    /// stays indexed and counted on disk while it is out.
    file: Option<PathBuf>,
}

/// How a taken entry's restore ended (`Spill::settle`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Settled {
    /// Not restored (refused by the request, or the request ended first).
    NotRestored,
    /// Its cells are a branch's now.
    Restored,
    /// Not what it was indexed as (another model's, a malformed snapshot).
    Corrupt,
}

/// Recurrent-state checkpoints as a spilled entry carries them: (position, state).
pub(crate) type SpilledCheckpoints = Vec<(u32, Arc<[u8]>)>;

/// What `unpack` finds in a spilled entry.
pub(crate) struct Unpacked {
    /// The length of the snapshot at its start.
    pub snapshot_len: usize,
    /// Its first cells are not in the snapshot: the tokens before this position (0: none).
    pub anchor: usize,
    pub checkpoints: SpilledCheckpoints,
}

/// A spilled entry's bytes: `snapshot` (of the cells after `anchor`), then each checkpoint
/// (position, length, state), then their count, the anchor and the snapshot's length, so that
/// `unpack` finds the snapshot in place.
pub(crate) fn pack(
    mut snapshot: Vec<u8>,
    anchor: usize,
    checkpoints: &SpilledCheckpoints,
) -> Vec<u8> {
    let len = snapshot.len() as u64;
    for (pos, state) in checkpoints {
        snapshot.extend_from_slice(&pos.to_le_bytes());
        snapshot.extend_from_slice(&(state.len() as u64).to_le_bytes());
        snapshot.extend_from_slice(state);
    }
    snapshot.extend_from_slice(&(checkpoints.len() as u32).to_le_bytes());
    snapshot.extend_from_slice(&(anchor as u32).to_le_bytes());
    snapshot.extend_from_slice(&len.to_le_bytes());
    snapshot
}

/// A `pack`ed entry's parts (the snapshot stays in place: `entry[..snapshot_len]`).
pub(crate) fn unpack(entry: &[u8]) -> Result<Unpacked> {
    let bad = || Error::State("a spilled prefix-cache entry is malformed".into());
    let tail = entry.len().checked_sub(16).ok_or_else(bad)?;
    let word = |at: usize| u32::from_le_bytes(entry[at..at + 4].try_into().expect("4 bytes"));
    let (count, anchor) = (word(tail), word(tail + 4) as usize);
    let len = u64::from_le_bytes(entry[tail + 8..].try_into().expect("8 bytes")) as usize;
    let mut at = len;
    let mut checkpoints = Vec::with_capacity((count as usize).min(1024));
    for _ in 0..count {
        // The lengths come from a file: sums past usize are malformed entries too.
        let body = at.checked_add(12).ok_or_else(bad)?;
        let head = entry.get(at..body).ok_or_else(bad)?;
        let pos = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
        let n = u64::from_le_bytes(head[4..].try_into().expect("8 bytes")) as usize;
        let end = body.checked_add(n).ok_or_else(bad)?;
        let state = entry.get(body..end).ok_or_else(bad)?;
        checkpoints.push((pos, Arc::from(state)));
        at = end;
    }
    if at != tail {
        return Err(bad());
    }
    Ok(Unpacked {
        snapshot_len: len,
        anchor,
        checkpoints,
    })
}

impl Spill {
    /// The levels of `config` for a context of cache `layout`; with a directory, the entries
    /// a previous run left there (those of another layout are left alone).
    pub fn open(config: SpillConfig, layout: u64) -> Result<Self> {
        let mut spill = Spill {
            config,
            layout,
            trie: PrefixTrie::new(),
            entries: HashMap::new(),
            next_id: first_id(),
            host: LevelStats::default(),
            disk: LevelStats::default(),
            writes: Vec::new(),
        };
        if let Some(dir) = spill.config.disk_dir.clone() {
            fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
            check_writable(&dir)?;
            spill.scan(&dir)?;
        }
        Ok(spill)
    }

    /// Index the files of `dir`, oldest first (so the newest are the last evicted). Only
    /// regular files are read (a FIFO would block the open); another model's, layout's or
    /// format version's are left alone; what a crash left (a stale `.tmp`, a cut file) goes.
    fn scan(&mut self, dir: &Path) -> Result<()> {
        let mut found = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let path = entry.path();
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            let modified = entry.metadata().and_then(|m| m.modified()).ok();
            if ext == "tmp" {
                // A write a crash cut short; a recent one may be another cache's, under way.
                let age = modified.and_then(|m| m.elapsed().ok());
                if age.is_some_and(|a| a > STALE_WRITE) {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            if ext != EXTENSION {
                continue;
            }
            match read_header(&path) {
                Ok(Some((layout, anchor, tokens, bytes))) if layout == self.layout => {
                    found.push((modified, path, tokens, anchor, bytes))
                }
                Ok(_) => {} // another model's, layout's or version's: not ours to load or remove
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    let _ = fs::remove_file(&path); // cut short, or not an entry at all
                }
                Err(_) => {} // unreadable now (permissions, I/O): left as it is
            }
        }
        found.sort_by_key(|f| f.0);
        for (_, path, tokens, anchor, bytes) in found {
            let Some(id) = id_of(&path) else {
                let _ = fs::remove_file(&path);
                continue;
            };
            self.insert(id, tokens, anchor, bytes, Place::Disk(path));
        }
        self.fit_disk();
        Ok(())
    }

    fn new_id(&mut self) -> u64 {
        while self.entries.contains_key(&self.next_id) {
            self.next_id = self.next_id.wrapping_add(1);
        }
        self.next_id = self.next_id.wrapping_add(1);
        self.next_id.wrapping_sub(1)
    }

    fn insert(&mut self, id: u64, tokens: Vec<Token>, anchor: usize, bytes: usize, place: Place) {
        self.trie.insert(id, &tokens);
        self.trie.set_evictable(id, true);
        let level = self.level(place.on_disk());
        level.entries += 1;
        level.bytes += bytes;
        self.entries.insert(
            id,
            Entry {
                tokens,
                anchor,
                bytes,
                place,
            },
        );
    }

    /// The disk level's counts, or host memory's.
    fn level(&mut self, disk: bool) -> &mut LevelStats {
        if disk {
            &mut self.disk
        } else {
            &mut self.host
        }
    }

    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.trie.remove(id);
        let level = self.level(entry.place.on_disk());
        level.entries -= 1;
        level.bytes -= entry.bytes;
        Some(entry)
    }

    /// Keep an entry evicted from the KV cache (`pack`ed, its snapshot without the cells of
    /// its first `anchor` tokens), holding `tokens`: in host memory, moving the least recently
    /// used ones to disk (`take_writes`) or dropping them to stay in budget.
    pub fn keep(&mut self, tokens: Vec<Token>, snapshot: Vec<u8>, anchor: usize) {
        if tokens.is_empty() {
            return;
        }
        // The same tokens spilled before are stale now.
        if let Some(stale) = self.holding(&tokens) {
            self.drop_entry(stale);
        }
        let id = self.new_id();
        let bytes = snapshot.len();
        if bytes <= self.config.host_bytes {
            self.insert(id, tokens, anchor, bytes, Place::Host(Arc::new(snapshot)));
            self.fit_host();
        } else {
            self.write_to_disk(id, tokens, anchor, Arc::new(snapshot));
        }
    }

    /// Move host entries to disk, least recently used first, until host memory fits.
    fn fit_host(&mut self) {
        while self.host.bytes > self.config.host_bytes {
            let Some(id) = self.lru_at(false) else { break };
            let entry = self.remove(id).expect("listed");
            if let Place::Host(snapshot) = entry.place {
                self.write_to_disk(id, entry.tokens, entry.anchor, snapshot);
            }
        }
    }

    /// Drop disk entries, least recently used first, until the directory fits.
    fn fit_disk(&mut self) {
        while self.disk.bytes > self.config.disk_bytes {
            let Some(id) = self.lru_at(true) else { break };
            self.drop_entry(id);
        }
    }

    /// The least recently used entry on disk (`true`) or in host memory.
    fn lru_at(&self, disk: bool) -> Option<u64> {
        self.trie.evict_order().into_iter().find(|id| {
            self.entries
                .get(id)
                .is_some_and(|e| e.place.on_disk() == disk)
        })
    }

    /// Index entry `id` on disk and hand out its file to write (dropped when it cannot fit).
    fn write_to_disk(&mut self, id: u64, tokens: Vec<Token>, anchor: usize, entry: Arc<Vec<u8>>) {
        let Some(dir) = self.config.disk_dir.clone() else {
            return;
        };
        let bytes = header_len(&tokens) + entry.len();
        if bytes > self.config.disk_bytes {
            return;
        }
        self.writes.push(DiskWrite {
            id,
            path: dir.join(format!("{id:016x}.{EXTENSION}")),
            layout: self.layout,
            anchor,
            tokens: tokens.clone(),
            entry: entry.clone(),
        });
        self.insert(id, tokens, anchor, bytes, Place::Writing(entry));
        self.fit_disk();
    }

    /// The files to write now (outside the cache's lock), each reported to `written`.
    pub fn take_writes(&mut self) -> Vec<DiskWrite> {
        std::mem::take(&mut self.writes)
    }

    /// `write`'s file is written (`ok`) or failed: the entry is on disk now, or gone. One
    /// taken or dropped meanwhile has its file removed.
    pub fn written(&mut self, write: &DiskWrite, ok: bool) {
        let id = write.id;
        match self.entries.get_mut(&id) {
            Some(entry) if matches!(entry.place, Place::Writing(_)) => {
                if ok {
                    entry.place = Place::Disk(write.path.clone());
                } else {
                    self.remove(id);
                }
            }
            _ => {
                let _ = fs::remove_file(&write.path);
            }
        }
    }

    /// Forget the entries whose file is gone (removed by another hand): they are not on disk.
    pub fn forget_missing_files(&mut self) {
        let missing: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(&e.place, Place::Disk(path) if !path.exists()))
            .map(|(&id, _)| id)
            .collect();
        for id in missing {
            self.remove(id);
        }
    }

    /// Forget entry `id` and remove its file (also a taken one whose file could not be read
    /// as the entry).
    pub fn drop_entry(&mut self, id: u64) {
        if let Some(Entry {
            place: Place::Disk(path),
            ..
        }) = self.remove(id)
        {
            let _ = fs::remove_file(path);
        }
    }

    /// Move every entry held in host memory to disk (as far as the disk budget goes; the
    /// files to write are `take_writes`): what a restart finds. How many go.
    pub fn flush_to_disk(&mut self) -> usize {
        let host: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| matches!(e.place, Place::Host(_)))
            .map(|(&id, _)| id)
            .collect();
        let before = self.disk.entries;
        for id in host {
            if let Some(Entry {
                tokens,
                anchor,
                place: Place::Host(snapshot),
                ..
            }) = self.remove(id)
            {
                self.write_to_disk(id, tokens, anchor, snapshot);
            }
        }
        self.disk.entries.saturating_sub(before)
    }

    /// The spilled entry sharing the longest prefix with `tokens`: its id, that length, and
    /// its anchor (the first tokens whose cells its snapshot leaves out).
    pub fn best(&self, tokens: &[Token]) -> Option<(u64, usize, usize)> {
        let m = self.trie.longest_prefix(tokens)?;
        Some((m.key, m.len, self.entries.get(&m.key)?.anchor))
    }

    /// Take entry `id` out to restore it (`Taking::read` reads its file). An entry on disk
    /// stays indexed and counted against the disk budget while it is out (its file is there
    /// all along), only no request finds it; one in memory leaves its level.
    pub fn take(&mut self, id: u64) -> Option<Taking> {
        let entry = self.entries.get(&id)?;
        let (tokens, anchor, place) = match &entry.place {
            Place::Disk(path) => {
                let out = (
                    entry.tokens.clone(),
                    entry.anchor,
                    Place::Disk(path.clone()),
                );
                self.trie.remove(id);
                out
            }
            _ => {
                let entry = self.remove(id)?;
                (entry.tokens, entry.anchor, entry.place)
            }
        };
        Some(Taking {
            id,
            tokens,
            anchor,
            layout: self.layout,
            place,
        })
    }

    /// A taken entry done with. Not restored, it goes back where it was; restored, one on
    /// disk stays there (a crash then loses nothing that was on disk), one in memory goes
    /// (its cells are in the KV cache); corrupt, it is dropped, file and all. One whose tokens
    /// were spilled again meanwhile is dropped as stale.
    pub fn settle(&mut self, taken: Taken, how: Settled) {
        if taken.file.is_some() {
            let stale = self.holding(&taken.tokens).is_some();
            if how == Settled::Corrupt || stale {
                self.drop_entry(taken.id);
            } else if self.entries.contains_key(&taken.id) {
                self.trie.insert(taken.id, &taken.tokens);
                self.trie.set_evictable(taken.id, true);
                self.fit_disk();
            }
            return;
        }
        if how != Settled::NotRestored || self.holding(&taken.tokens).is_some() {
            return; // in memory only: nothing to remove
        }
        let Taken {
            id,
            entry,
            tokens,
            anchor,
            ..
        } = taken;
        self.insert(id, tokens, anchor, entry.len(), Place::Host(entry));
        self.fit_host();
    }

    /// The entry that holds exactly `tokens`, if one does.
    fn holding(&self, tokens: &[Token]) -> Option<u64> {
        self.trie
            .longest_prefix(tokens)
            .filter(|m| m.exact && m.len == tokens.len())
            .map(|m| m.key)
    }

    /// An entry restored from a level: counted as a hit there.
    pub fn restored(&mut self, from_disk: bool, tokens: usize) {
        let level = self.level(from_disk);
        level.hits += 1;
        level.restored_tokens += tokens as u64;
    }

    /// (host memory, disk) counts.
    pub fn stats(&self) -> (LevelStats, LevelStats) {
        (self.host, self.disk)
    }
}

/// Magic, version, layout, anchor, token count, tokens.
fn header_len(tokens: &[Token]) -> usize {
    4 + 4 + 8 + 4 + 4 + 4 * tokens.len()
}

/// The header of an entry's file (`header_len` bytes).
fn header(layout: u64, anchor: usize, tokens: &[Token]) -> Vec<u8> {
    let mut out = Vec::with_capacity(header_len(tokens));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&layout.to_le_bytes());
    out.extend_from_slice(&(anchor as u32).to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out
}

/// The first id of a spill's entries: a random range of 2^32, so that two caches on one
/// directory (or a cache and the one before a restart) do not number their files alike (the
/// second overwrote the first's: every prompt then came back cold).
fn first_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    random & !0xffff_ffff
}

/// A directory the cache cannot write to is refused when the cache opens, not found out at
/// its first spill (whose entry would be dropped, a server's warning in its log).
fn check_writable(dir: &Path) -> Result<()> {
    // A ".tmp" name: what a crash leaves of it, the next scan removes.
    let probe = dir.join(format!("probe-{}.tmp", std::process::id()));
    fs::File::create(&probe).map_err(|e| Error::io(dir, e))?;
    let _ = fs::remove_file(&probe);
    Ok(())
}

fn write_file(
    path: &Path,
    layout: u64,
    anchor: usize,
    tokens: &[Token],
    snapshot: &[u8],
) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?; // removed while the cache ran: made again
    }
    let tmp = path.with_extension("tmp");
    let mut out = header(layout, anchor, tokens);
    out.reserve_exact(snapshot.len());
    out.extend_from_slice(snapshot);
    let mut file = fs::File::create(&tmp)?;
    file.write_all(&out)?;
    file.sync_all()?;
    fs::rename(&tmp, path)
}

/// A file's header: the cache layout, anchor, tokens and size.
type Header = (u64, usize, Vec<Token>, usize);

/// The header of an entry file; None for an entry file of another format version (another
/// kvfork's), an InvalidData error for a file that is not an entry file or was cut short.
fn read_header(path: &Path) -> std::io::Result<Option<Header>> {
    use std::io::Read;
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not a kvfork cache entry");
    let mut file = fs::File::open(path)?;
    let size = file.metadata()?.len() as usize;
    let mut head = [0u8; 24];
    file.read_exact(&mut head).map_err(|_| bad())?;
    let word = |i: usize| u32::from_le_bytes(head[i..i + 4].try_into().expect("4 bytes"));
    let layout = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
    if &head[..4] != MAGIC {
        return Err(bad());
    }
    if word(4) != VERSION {
        return Ok(None);
    }
    let (anchor, n) = (word(16) as usize, word(20) as usize);
    if 24 + 4 * n > size || anchor > n {
        return Err(bad());
    }
    let mut raw = vec![0u8; 4 * n];
    file.read_exact(&mut raw).map_err(|_| bad())?;
    let tokens = raw
        .chunks_exact(4)
        .map(|c| Token::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Ok(Some((layout, anchor, tokens, size)))
}

fn id_of(path: &Path) -> Option<u64> {
    let stem = path.file_stem()?.to_str()?;
    u64::from_str_radix(stem, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvfork-spill-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    /// Write the files handed out, as the prefix cache does outside its lock.
    fn settle(s: &mut Spill) {
        for w in s.take_writes() {
            let ok = w.run().is_ok();
            s.written(&w, ok);
        }
    }

    fn take(s: &mut Spill, id: u64) -> Taken {
        s.take(id).unwrap().read().unwrap()
    }

    fn config(host: usize, dir: &Path, disk: usize) -> SpillConfig {
        SpillConfig {
            host_bytes: host,
            disk_dir: Some(dir.to_path_buf()),
            disk_bytes: disk,
        }
    }

    #[test]
    fn host_overflows_to_disk_least_recently_used_first_and_comes_back() {
        let d = dir("levels");
        let mut s = Spill::open(config(250, &d, 10_000), 1).unwrap();
        for i in 0..4 {
            s.keep(vec![1, 2, i], vec![i as u8; 100], 0);
        }
        settle(&mut s);
        let (host, disk) = s.stats();
        assert_eq!((host.entries, host.bytes), (2, 200));
        assert_eq!(disk.entries, 2);
        // The oldest went to disk: [1, 2, 0] is read back from its file. While it is out it
        // stays counted there (its file is there) but no request finds it; restored, it stays
        // on disk (a crash then loses nothing that was there).
        let (id, len, _) = s.best(&[1, 2, 0, 9]).unwrap();
        assert_eq!(len, 3);
        let taken = take(&mut s, id);
        assert!(taken.from_disk);
        assert_eq!(*taken.entry, vec![0u8; 100]);
        assert_eq!(s.stats().1.entries, 2);
        assert!(s.best(&[1, 2, 0, 9]).is_none_or(|(_, len, _)| len < 3));
        s.settle(taken, Settled::Restored);
        assert_eq!(s.best(&[1, 2, 0, 9]).map(|(i, ..)| i), Some(id));
        assert_eq!(fs::read_dir(&d).unwrap().count(), 2);
        // A host entry restored is gone from memory (its cells are in the KV cache).
        let (id, ..) = s.best(&[1, 2, 3]).unwrap();
        let taken = take(&mut s, id);
        assert!(!taken.from_disk);
        s.settle(taken, Settled::Restored);
        assert!(s.best(&[1, 2, 3]).is_none_or(|(_, len, _)| len < 3));
        assert_eq!(s.stats().0.entries, 1);
        // One found corrupt is dropped, file and all.
        let (id, ..) = s.best(&[1, 2, 0]).unwrap();
        let taken = take(&mut s, id);
        s.settle(taken, Settled::Corrupt);
        assert_eq!(s.stats().1.entries, 1);
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn an_entry_taken_and_not_restored_goes_back_where_it_was() {
        let d = dir("given-back");
        let mut s = Spill::open(config(150, &d, 10_000), 1).unwrap();
        s.keep(vec![1, 2, 3], vec![3; 100], 0);
        s.keep(vec![1, 2, 4], vec![4; 100], 0); // [1, 2, 3] goes to disk
        settle(&mut s);
        let before = s.stats();
        for tokens in [[1, 2, 3], [1, 2, 4]] {
            let (id, ..) = s.best(&tokens).unwrap();
            let taken = take(&mut s, id);
            assert!(s.best(&tokens).is_none_or(|(_, len, _)| len < 3));
            s.settle(taken, Settled::NotRestored);
            assert_eq!(s.best(&tokens).map(|(i, len, _)| (i, len)), Some((id, 3)));
        }
        assert_eq!(s.stats(), before);
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        // Spilled again while taken: the newer one stays, the taken one goes.
        let (id, ..) = s.best(&[1, 2, 3]).unwrap();
        let taken = take(&mut s, id);
        s.keep(vec![1, 2, 3], vec![5; 100], 0);
        s.settle(taken, Settled::NotRestored);
        let (again, ..) = s.best(&[1, 2, 3]).unwrap();
        assert_ne!(again, id);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_file_rewritten_with_other_tokens_is_refused_not_restored() {
        // Two caches on one directory number their files apart; should another hand rewrite
        // one with another entry, the first's index still says its own tokens.
        let d = dir("rewritten");
        let mut first = Spill::open(config(0, &d, 10_000), 1).unwrap();
        let mut second = Spill::open(config(0, &d, 10_000), 1).unwrap();
        first.keep(vec![1, 2, 3], vec![1; 40], 0);
        settle(&mut first);
        let ours = first.best(&[1, 2, 3]).unwrap().0;
        second.keep(vec![7, 8, 9], vec![2; 40], 0);
        settle(&mut second);
        let files: Vec<_> = fs::read_dir(&d)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .collect();
        assert_eq!(files.len(), 2, "two names");
        let (mine, theirs) = match id_of(&files[0]) == Some(ours) {
            true => (&files[0], &files[1]),
            false => (&files[1], &files[0]),
        };
        fs::copy(theirs, mine).unwrap();
        let err = first.take(ours).unwrap().read().err().unwrap();
        assert!(
            err.to_string().contains("no longer holds the tokens"),
            "{err}"
        );
        first.drop_entry(ours);
        assert_eq!(first.stats().1.entries, 0);
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_scan_leaves_what_is_not_its_own_alone() {
        let d = dir("not-ours");
        let mut theirs = Spill::open(config(0, &d, 10_000), 2).unwrap(); // another model's
        theirs.keep(vec![1, 2, 3], vec![1; 40], 0);
        settle(&mut theirs);
        // Another format version's file, a write under way, a FIFO (opening it would block).
        let mut newer = header(1, 0, &[4, 5]);
        newer[4..8].copy_from_slice(&(VERSION + 1).to_le_bytes());
        fs::write(d.join("00000000000000aa.kvfe"), &newer).unwrap();
        fs::write(d.join("00000000000000bb.tmp"), b"half").unwrap();
        let fifo = d.join("00000000000000cc.kvfe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        fs::write(d.join("00000000000000dd.kvfe"), b"junk").unwrap(); // cut short: goes
        let before = fs::read_dir(&d).unwrap().count();
        let ours = Spill::open(config(0, &d, 1), 1).unwrap(); // a budget nothing fits in
        assert_eq!(ours.stats().1.entries, 0);
        assert_eq!(fs::read_dir(&d).unwrap().count(), before - 1);
        assert!(!d.join("00000000000000dd.kvfe").exists());
        if made.is_ok_and(|s| s.success()) {
            assert!(fifo.exists());
        }
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_directory_removed_while_running_is_made_again_and_its_lost_files_forgotten() {
        let d = dir("removed");
        let mut s = Spill::open(config(0, &d, 10_000), 1).unwrap();
        s.keep(vec![1, 2], vec![1; 30], 0);
        settle(&mut s);
        fs::remove_dir_all(&d).unwrap();
        s.forget_missing_files();
        assert_eq!(s.stats().1.entries, 0);
        s.keep(vec![3, 4], vec![2; 30], 0);
        settle(&mut s);
        assert_eq!(s.stats().1.entries, 1);
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn a_reopened_directory_is_indexed_and_trimmed_to_its_budget() {
        let d = dir("reopen");
        {
            let mut s = Spill::open(config(0, &d, 10_000), 1).unwrap();
            for i in 0..3 {
                s.keep(vec![5, i], vec![7; 50], i as usize);
            }
            settle(&mut s);
            assert_eq!(s.stats().1.entries, 3);
        }
        // A write a crash cut short long ago, and one under way (another cache's, maybe).
        let stale = d.join("0000000000000009.tmp");
        fs::write(&stale, b"cut short").unwrap();
        let long_ago = std::time::SystemTime::now() - 2 * STALE_WRITE;
        let file = fs::File::options().write(true).open(&stale).unwrap();
        file.set_modified(long_ago).unwrap();
        fs::write(d.join("000000000000000b.tmp"), b"being written").unwrap();
        fs::write(d.join("000000000000000a.kvfe"), b"KVFE garbage").unwrap();
        // Room for two of the three: one is dropped, the junk and the stale write removed.
        let s = Spill::open(config(0, &d, 2 * (header_len(&[5, 0]) + 50)), 1).unwrap();
        // Another cache layout finds none of them (and removes none).
        assert_eq!(
            Spill::open(config(0, &d, 10_000), 2)
                .unwrap()
                .stats()
                .1
                .entries,
            0
        );
        assert_eq!(s.stats().1.entries, 2);
        assert_eq!(fs::read_dir(&d).unwrap().count(), 3);
        assert!(!stale.exists() && d.join("000000000000000b.tmp").exists());
        assert!(s.best(&[5, 1]).is_some() || s.best(&[5, 2]).is_some());
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn an_entry_carries_its_checkpoints_after_the_snapshot() {
        let snapshot = vec![9u8; 33];
        let checkpoints: SpilledCheckpoints =
            vec![(4, Arc::from(&[1u8, 2, 3][..])), (16, Arc::from(&[][..]))];
        let entry = pack(snapshot.clone(), 7, &checkpoints);
        let back = unpack(&entry).unwrap();
        assert_eq!(&entry[..back.snapshot_len], &snapshot[..]);
        assert_eq!((back.anchor, back.checkpoints), (7, checkpoints));
        let none = unpack(&pack(snapshot, 0, &Vec::new())).unwrap();
        assert_eq!(
            (none.snapshot_len, none.anchor, none.checkpoints.len()),
            (33, 0, 0)
        );
        // Cut anywhere, or with a count that overruns, it is refused, never misread.
        for cut in 0..entry.len() {
            assert!(unpack(&entry[..cut]).is_err(), "cut at {cut}");
        }
        let mut overrun = entry.clone();
        let tail = overrun.len() - 16;
        overrun[tail..tail + 4].copy_from_slice(&3u32.to_le_bytes());
        assert!(unpack(&overrun).is_err());
    }

    #[test]
    fn the_same_tokens_spilled_again_replace_the_older_entry() {
        let d = dir("same");
        let mut s = Spill::open(config(1000, &d, 0), 1).unwrap();
        s.keep(vec![1, 2, 3], vec![1; 10], 0);
        s.keep(vec![1, 2, 3], vec![2; 10], 0);
        assert_eq!(s.stats().0.entries, 1);
        let (id, _, _) = s.best(&[1, 2, 3]).unwrap();
        assert_eq!(*take(&mut s, id).entry, vec![2; 10]);
        let _ = fs::remove_dir_all(&d);
    }

    #[test]
    fn an_entry_going_to_disk_is_served_from_memory_and_its_late_file_removed() {
        let d = dir("writing");
        let mut s = Spill::open(config(0, &d, 10_000), 1).unwrap();
        s.keep(vec![3, 4], vec![5; 40], 0);
        s.keep(vec![6, 7], vec![8; 40], 0);
        // Both count on disk before their files are written.
        assert_eq!(s.stats().1.entries, 2);
        let writes = s.take_writes();
        assert_eq!(writes.len(), 2);
        // One is taken while its file is still being written: served from memory, and the
        // file is removed once written, leaving the other's.
        let (id, _, _) = s.best(&[3, 4]).unwrap();
        let taken = take(&mut s, id);
        assert_eq!((*taken.entry).clone(), vec![5; 40]);
        for w in &writes {
            assert!(w.run().is_ok());
            s.written(w, true);
        }
        assert_eq!(fs::read_dir(&d).unwrap().count(), 1);
        assert_eq!(s.stats().1.entries, 1);
        // A failed write drops its entry.
        s.keep(vec![9], vec![1; 40], 0);
        let failed = s.take_writes();
        s.written(&failed[0], false);
        assert!(s.best(&[9]).is_none());
        assert_eq!(s.stats().1.entries, 1);
        let _ = fs::remove_dir_all(&d);
    }
}
