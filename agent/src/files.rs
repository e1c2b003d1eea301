//! A site's files in its state folder: the checkpoint the agent resumes from, and the copies of
//! its model and progress for people and tools.

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use std::cell::Cell;
use std::path::{Path, PathBuf};
use unifed_models::checkpoint;
use unifed_models::client::ClientState;
use unifed_models::site::{Memory, MemoryLayout, Site};
use unifed_models::state::{Select, import_into};
use unifed_protocol::ModelSpec;
use unifed_site::Progress;

/// A site's files in its state folder. `checkpoint.bin` is the one the agent resumes from:
/// progress, memory (error-feedback residuals, control variates) and the number of the model
/// file, in one file replaced atomically, so a crash never leaves a model of one step beside
/// the memory of another. The model is `checkpoint.{n}.safetensors`, a new file for each
/// checkpoint, made durable before the checkpoint names it and never written again: so
/// `model.safetensors` (the site's full model, for tools and people) is a hard link to it, not
/// a copy, and `progress.json` a copy of the progress, both replaced after the checkpoint.
pub(crate) struct SiteFiles {
    dir: PathBuf,
    checkpoint: PathBuf,
    model: PathBuf,
    progress: PathBuf,
    /// Scratch: the starting model while a round trains ([`Site::park_base_in`]).
    pub(crate) parked: PathBuf,
    /// The number of the next model file: one more than the checkpoint's.
    next: Cell<u64>,
}

/// `checkpoint.bin` is this magic, the format version (u32, little-endian), then in postcard the
/// site's progress ([`Progress`]), its memory ([`Memory`]) and the model file's number, length
/// in bytes (two u64) and XXH3-128 (16 bytes, little-endian), then the XXH3-128 of everything
/// before it (16 bytes).
const CHECKPOINT_MAGIC: &[u8; 4] = b"UFSC";
/// 7 adds the run of the federation the progress is of ([`Progress::run`]), so a site whose
/// aggregator started afresh knows its state is of another run. 6 keeps the algorithm's state typed (`ClientState`) where 5 and earlier kept SCAFFOLD's
/// variates, MOON's previous model and FedDC's drift in fields of their own
/// ([`MemoryLayout::Fields`]). 5 added the two sums: of the model file, and of the checkpoint
/// itself. 4 moved the model out to a file of its own, 3 held its safetensors bytes at the end,
/// and 2 a memory without MOON's previous local model and FedDC's drift; all four are still
/// read.
const CHECKPOINT_VERSION: u32 = 7;

/// Bytes of an XXH3-128 sum.
const SUM_LEN: usize = 16;

/// A writer or reader that sums (XXH3-128) the bytes that pass through it.
struct Summing<T> {
    inner: T,
    sum: xxhash_rust::xxh3::Xxh3Default,
}

impl<T> Summing<T> {
    /// `inner`, with `first` summed already (bytes that went by before).
    fn new(inner: T, first: &[u8]) -> Self {
        let mut sum = xxhash_rust::xxh3::Xxh3Default::new();
        sum.update(first);
        Summing { inner, sum }
    }

    /// The sum of everything so far.
    fn sum(&self) -> [u8; SUM_LEN] {
        self.sum.digest128().to_le_bytes()
    }
}

impl<W: std::io::Write> std::io::Write for Summing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.sum.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<R: std::io::Read> std::io::Read for Summing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.sum.update(&buf[..n]);
        Ok(n)
    }
}

/// The progress of a checkpoint of version 6 or earlier: no run.
#[derive(Deserialize)]
struct ProgressV6 {
    applied_version: Option<u64>,
    answered_rounds: Vec<u64>,
}

impl From<ProgressV6> for Progress {
    fn from(p: ProgressV6) -> Progress {
        Progress {
            applied_version: p.applied_version,
            answered_rounds: p.answered_rounds,
            run: None,
        }
    }
}

/// The memory of a version 2 checkpoint: [`Memory`] before MOON's previous local model and
/// FedDC's drift.
#[derive(Deserialize)]
struct MemoryV2 {
    residual: std::collections::BTreeMap<String, Vec<f32>>,
    control: std::collections::BTreeMap<String, Vec<f32>>,
    server_control: Option<(u64, std::collections::BTreeMap<String, Vec<f32>>)>,
    held: Option<(u64, std::collections::BTreeMap<String, Vec<f32>>)>,
}

impl SiteFiles {
    /// The files of the state folder `dir`.
    pub(crate) fn new(dir: &Path) -> Self {
        SiteFiles {
            dir: dir.to_path_buf(),
            checkpoint: dir.join("checkpoint.bin"),
            model: dir.join("model.safetensors"),
            progress: dir.join("progress.json"),
            parked: dir.join("training-base.f32"),
            next: Cell::new(0),
        }
    }

    /// Writes the federation's model spec beside `model.safetensors`
    /// (`model.safetensors.spec.json`, as `unifed-agent init` does for its model), so that
    /// `evaluate` and `predict` take the site's model as it is. Replaced only when it differs.
    pub(crate) fn write_spec(&self, spec: &ModelSpec) -> Result<()> {
        let path = unifed_protocol::spec_path(&self.model);
        let text = serde_json::to_vec_pretty(spec)?;
        if std::fs::read(&path).is_ok_and(|old| old == text) {
            return Ok(());
        }
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, &text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }

    /// Moves the site's state of the run named `run` (checkpoint, model files, progress, parked
    /// training files) into `runs/<run>/` of the state folder, where it stays for people and
    /// tools, and leaves the folder as a new site's: what the agent does when its aggregator
    /// starts a later run. The lock, the kernel cache and earlier runs stay where they are.
    pub(crate) fn put_aside(&self, run: &str) -> Result<PathBuf> {
        let to = self.dir.join("runs").join(run);
        std::fs::create_dir_all(&to).with_context(|| format!("creating {}", to.display()))?;
        let entries = std::fs::read_dir(&self.dir)
            .with_context(|| format!("reading {}", self.dir.display()))?;
        for e in entries {
            let e = e.with_context(|| format!("reading {}", self.dir.display()))?;
            let name = e.file_name();
            let n = name.to_string_lossy();
            let state = n == "checkpoint.bin"
                || n.starts_with("checkpoint.")
                || n.starts_with("model.safetensors")
                || n == "progress.json"
                || n.starts_with("training-base.");
            if state && e.file_type().is_ok_and(|t| t.is_file()) {
                std::fs::rename(e.path(), to.join(&name)).with_context(|| {
                    format!("moving {} to {}", e.path().display(), to.display())
                })?;
            }
        }
        self.next.set(0);
        Ok(to)
    }

    /// The run the site's saved progress (`progress.json`) is of, if it names one.
    pub(crate) fn saved_run(&self) -> Option<unifed_protocol::RunId> {
        let text = std::fs::read(&self.progress).ok()?;
        serde_json::from_slice::<Progress>(&text).ok()?.run
    }

    /// The model file numbered `n`.
    fn model_file(&self, n: u64) -> PathBuf {
        self.dir.join(format!("checkpoint.{n}.safetensors"))
    }

    /// Restores `site` from the checkpoint, its model and memory, and gives the progress it
    /// holds; `None` for a new site (nothing changes). The file is read as it goes: the memory
    /// (under a lossy encoding two model-sized maps) goes from the file to the site's own files
    /// a block at a time, and the model is read once, then moved into the site's.
    pub(crate) fn restore<N: unifed_models::zoo::Net>(
        &self,
        spec: &ModelSpec,
        site: &mut Site<N>,
    ) -> Result<Option<Progress>> {
        use std::io::Read;
        let p = &self.checkpoint;
        let f = match std::fs::File::open(p) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("reading {}", p.display())),
        };
        let len = f
            .metadata()
            .with_context(|| format!("reading {}", p.display()))?
            .len();
        let mut r = std::io::BufReader::with_capacity(1 << 20, f);
        let mut head = [0u8; 8];
        if r.read_exact(&mut head).is_err() || &head[..4] != CHECKPOINT_MAGIC {
            bail!("{}: not a site checkpoint", p.display());
        }
        let v = u32::from_le_bytes(head[4..8].try_into().expect("4 bytes"));
        let (progress, model) = match v {
            CHECKPOINT_VERSION | 6 | 5 | 4 | 3 => {
                // The progress, the memory, then the model's file (see `CHECKPOINT_MAGIC`), or
                // in version 3 its bytes.
                let r = Summing::new(r, &head);
                let mut scratch = vec![0u8; 1 << 12];
                let layout = match v {
                    CHECKPOINT_VERSION | 6 => MemoryLayout::Typed,
                    _ => MemoryLayout::Fields,
                };
                let (progress, (r, _)) = match v {
                    CHECKPOINT_VERSION => postcard::from_io::<Progress, _>((r, &mut scratch)),
                    _ => postcard::from_io::<ProgressV6, _>((r, &mut scratch))
                        .map(|(p, rest)| (p.into(), rest)),
                }
                .with_context(|| format!("reading {}", p.display()))?;
                let mut r = site
                    .restore_memory_from(r, spec, layout)
                    .with_context(|| format!("{}", p.display()))?;
                let model = match v {
                    3 => read_embedded_model(&mut r, len),
                    _ => self.read_model_file(&mut r, v >= 5),
                }
                .with_context(|| format!("reading {}", p.display()))?;
                if v >= 5 {
                    check_trailer(r).with_context(|| format!("reading {}", p.display()))?;
                }
                (progress, model)
            }
            2 => {
                let mut bytes = Vec::new();
                r.read_to_end(&mut bytes)
                    .with_context(|| format!("reading {}", p.display()))?;
                let (progress, m, model) =
                    postcard::from_bytes::<(ProgressV6, MemoryV2, Vec<u8>)>(&bytes)
                        .with_context(|| format!("reading {}", p.display()))?;
                let progress = Progress::from(progress);
                let memory = Memory {
                    residual: m.residual,
                    held: m.held,
                    algorithm: ClientState::from_fields(
                        m.control,
                        m.server_control,
                        None,
                        Default::default(),
                    ),
                };
                site.restore_memory(memory, spec)
                    .with_context(|| format!("{}", p.display()))?;
                (progress, model)
            }
            v => bail!(
                "{}: format version {v} is not {CHECKPOINT_VERSION} (or 6, 5, 4, 3 or 2, which \
                 it reads)",
                p.display()
            ),
        };
        let state = checkpoint::from_bytes(&model, spec)
            .with_context(|| format!("the model in {}", p.display()))?;
        drop(model);
        // The tensors move into the model, each old one freed as its new one goes in.
        import_into(&mut site.net, spec, state, Select::All)
            .with_context(|| format!("the model in {}", p.display()))?;
        Ok(Some(progress))
    }

    /// The model of a version 4 or 5 checkpoint, whose number and length (and `summed`, its
    /// sum) `r` reads next: its file's bytes, then one more than its number is the next file's.
    fn read_model_file(&self, r: &mut impl std::io::Read, summed: bool) -> Result<Vec<u8>> {
        let number = read_varint(r)?;
        let want = read_varint(r)?;
        let mut sum = [0u8; SUM_LEN];
        if summed {
            r.read_exact(&mut sum)?;
        }
        let m = self.model_file(number);
        let model = std::fs::read(&m)
            .with_context(|| format!("reading {}, the model the checkpoint names", m.display()))?;
        if model.len() as u64 != want {
            bail!(
                "{}: {} bytes, but the checkpoint names a model of {want}",
                m.display(),
                model.len()
            );
        }
        if summed && xxhash_rust::xxh3::xxh3_128(&model).to_le_bytes() != sum {
            bail!(
                "{}: its bytes are not the model the checkpoint names (their sum differs): the \
                 file was damaged or written by another program",
                m.display()
            );
        }
        self.next.set(number.wrapping_add(1));
        Ok(model)
    }

    /// Writes the model to a new file, then replaces the checkpoint atomically, then its copies,
    /// and removes the model files no checkpoint names. The model is written from its tensors a
    /// block at a time: it is never exported or serialised whole.
    pub(crate) fn write<N: unifed_models::zoo::Net>(
        &self,
        spec: &ModelSpec,
        site: &Site<N>,
        progress: &Progress,
    ) -> Result<()> {
        use std::io::Write;
        let layout = checkpoint::Layout::of_spec(spec);
        let number = self.next.get();
        let model = self.model_file(number);
        // Both files go to the disk as they are written (`WritingBack`), so their fsyncs wait
        // for little: the last site to upload checkpoints while the round folds, and fetches
        // the next model only after. The model file needs no rename: nothing names it until
        // the checkpoint does, whose rename and folder sync make both lasting. It is made
        // read-only, as `model.safetensors` is the same file: a tool that opened that for
        // writing would change what the agent resumes from. (A file of this number a crash
        // left, read-only too, is removed first.)
        let model_sum = (|| -> std::io::Result<[u8; SUM_LEN]> {
            remove_if_present(&model)?;
            let mut w = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&model)?);
            let mut summed = Summing::new(unifed_net::disk::WritingBack::new(&mut w), &[]);
            layout.write_net(&site.net, &mut summed)?;
            let sum = summed.sum();
            w.flush()?;
            let f = w.get_ref();
            let mut read_only = f.metadata()?.permissions();
            read_only.set_readonly(true);
            f.set_permissions(read_only)?;
            f.sync_all()?;
            Ok(sum)
        })()
        .with_context(|| format!("writing {}", model.display()))?;
        // The memory (under a lossy encoding two model-sized maps) streams to the file from the
        // files where it waits, never through a buffer or a copy in memory.
        checkpoint::write_atomic_with(&self.checkpoint, |w| {
            let mut w = Summing::new(unifed_net::disk::WritingBack::new(w), &[]);
            w.write_all(CHECKPOINT_MAGIC)?;
            w.write_all(&CHECKPOINT_VERSION.to_le_bytes())?;
            postcard::to_io(
                &(
                    progress,
                    site.stored_memory(),
                    (number, layout.len(), model_sum),
                ),
                &mut w,
            )
            .map_err(std::io::Error::other)?;
            let sum = w.sum();
            w.inner.write_all(&sum)
        })?;
        self.next.set(number.wrapping_add(1));
        self.link_model(&model)?;
        checkpoint::write_atomic(&self.progress, &serde_json::to_vec_pretty(progress)?)
            .with_context(|| format!("writing {}", self.progress.display()))?;
        self.remove_models_but(number);
        Ok(())
    }

    /// Replaces `model.safetensors` with a hard link to `model` (a copy where the file system
    /// has no hard links).
    fn link_model(&self, model: &Path) -> Result<()> {
        let tmp = self.dir.join("model.safetensors.tmp");
        remove_if_present(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
        if std::fs::hard_link(model, &tmp).is_err() {
            std::fs::copy(model, &tmp)
                .with_context(|| format!("copying {} to {}", model.display(), tmp.display()))?;
        }
        std::fs::rename(&tmp, &self.model)
            .with_context(|| format!("renaming {} to {}", tmp.display(), self.model.display()))
    }

    /// Removes every model file but number `keep`: the checkpoint's last, and any a crash left
    /// before its checkpoint named it. A file that will not go is reported and left.
    fn remove_models_but(&self, keep: u64) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let number = name
                .to_str()
                .and_then(|n| n.strip_prefix("checkpoint."))
                .and_then(|n| n.strip_suffix(".safetensors"))
                .and_then(|n| n.parse::<u64>().ok());
            if number.is_some_and(|n| n != keep)
                && let Err(err) = std::fs::remove_file(e.path())
            {
                eprintln!("could not remove {}: {err}", e.path().display());
            }
        }
    }
}

/// The model's safetensors bytes at the end of a version 3 checkpoint of `len` bytes, which
/// `r` reads next (a byte string: its length, then the bytes).
fn read_embedded_model(r: &mut impl std::io::Read, len: u64) -> Result<Vec<u8>> {
    let n = read_varint(r)?;
    if n > len {
        bail!("a model of {n} bytes in a file of {len}");
    }
    let mut model = vec![0u8; n as usize];
    r.read_exact(&mut model)?;
    Ok(model)
}

/// Checks the sum that ends a version 5 checkpoint against the sum of what `r` has read, and
/// that nothing follows it.
fn check_trailer<R: std::io::Read>(mut r: Summing<R>) -> Result<()> {
    let read = r.sum();
    let mut trailer = [0u8; SUM_LEN];
    r.inner
        .read_exact(&mut trailer)
        .context("the checkpoint ends before its sum")?;
    if trailer != read {
        bail!("its sum differs from its bytes: the file was damaged");
    }
    let mut more = [0u8; 1];
    if r.inner.read(&mut more)? != 0 {
        bail!("bytes after its sum");
    }
    Ok(())
}

/// Removes the file at `path`, if there is one.
fn remove_if_present(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A postcard varint (LEB128, at most ten bytes) read from `r`.
fn read_varint(r: &mut impl std::io::Read) -> std::io::Result<u64> {
    let mut v = 0u64;
    for i in 0..10 {
        let mut b = [0u8; 1];
        r.read_exact(&mut b)?;
        v |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "a length longer than ten bytes",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use unifed_models::state::export;

    #[test]
    fn a_checkpoint_restores_model_memory_and_progress_and_versions_2_3_and_4_too() {
        use unifed_models::client::Controls;
        use unifed_models::data::Dataset;
        use unifed_models::zoo::{MlpConfig, seeded, spec_of};
        let device = unifed_models::backend::Backend::Flex.device().unwrap();
        let mlp = |seed| {
            seeded(&device, seed, |d| {
                MlpConfig {
                    inputs: 4,
                    hidden: [3, 3],
                    classes: 2,
                }
                .init(d)
            })
        };
        let net = mlp(1);
        let spec = spec_of(
            &net,
            &["a".into(), "b".into()],
            &unifed_protocol::Input::Features { len: 4 },
        );
        let empty = || Dataset {
            name: "none".into(),
            features: 4,
            x: Vec::new(),
            y: Vec::new(),
        };
        // A site with another model, parking in `dir`, as the agent starts one.
        let fresh = |dir: &std::path::Path| {
            let mut s = Site::new("a", mlp(2), empty(), empty()).unwrap();
            s.park_base_in(dir.join("training-base.f32")).unwrap();
            s
        };
        let state = export(&net, &spec, Select::All);
        let model = checkpoint::to_bytes(&state, &spec).unwrap();
        let name = spec.tensors[0].name.clone();
        let residual: std::collections::BTreeMap<String, Vec<f32>> =
            [(name.clone(), vec![0.5; spec.tensors[0].numel()])].into();
        let progress = Progress {
            applied_version: Some(4),
            answered_rounds: vec![3, 4],
            run: None,
        };
        // The progress as versions 2 to 6 wrote it: no run (read back as `None`).
        let v6 = (progress.applied_version, &progress.answered_rounds);
        // Version 2's layout: the memory's four maps, then the model.
        let old = (
            &v6,
            (&residual, &residual, None::<(u64, ())>, None::<(u64, ())>),
            &model,
        );
        let dir = tempfile::tempdir().unwrap();
        let files = SiteFiles::new(dir.path());
        let mut bytes = CHECKPOINT_MAGIC.to_vec();
        bytes.extend_from_slice(&2u32.to_le_bytes());
        std::fs::write(&files.checkpoint, postcard::to_extend(&old, bytes).unwrap()).unwrap();
        let mut site = fresh(dir.path());
        assert_eq!(
            files.restore(&spec, &mut site).unwrap(),
            Some(progress.clone())
        );
        assert_eq!(export(&site.net, &spec, Select::All).tensors, state.tensors);
        let memory = site.memory().unwrap();
        // Its `c_i` is SCAFFOLD's state now.
        let scaffold = ClientState::Scaffold(Controls {
            control: residual.clone(),
            server: None,
        });
        assert_eq!(
            (&memory.residual, &memory.algorithm),
            (&residual, &scaffold)
        );
        assert!(memory.held.is_none());

        // Versions 3 and 4, from a site with a lossy encoding's memory.
        let lossy = Memory {
            held: Some((
                4,
                spec.tensors
                    .iter()
                    .map(|t| (t.name.clone(), vec![-1.25; t.numel()]))
                    .collect(),
            )),
            ..memory
        };
        site.restore_memory(lossy.clone(), &spec).unwrap();
        // A checkpoint of `version` holding `record` after the progress and the memory in the
        // fields of versions 3 to 5, restored into a fresh site: the progress, the lossy memory
        // and the model, bit for bit. (postcard writes a tuple as its fields one after the
        // other, as it writes a struct.)
        let fields = (
            &lossy.residual,
            &residual,
            None::<(u64, ())>,
            &lossy.held,
            None::<()>,
            std::collections::BTreeMap::<String, Vec<f32>>::new(),
        );
        let restores_old = |version: u32, record: Vec<u8>| {
            let mut bytes = CHECKPOINT_MAGIC.to_vec();
            bytes.extend_from_slice(&version.to_le_bytes());
            let mut bytes = postcard::to_extend(&(&v6, &fields), bytes).unwrap();
            bytes.extend_from_slice(&record);
            std::fs::write(&files.checkpoint, bytes).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let mut s = fresh(dir.path());
            assert_eq!(
                files.restore(&spec, &mut s).unwrap(),
                Some(progress.clone())
            );
            assert_eq!(s.memory().unwrap(), lossy);
            assert_eq!(export(&s.net, &spec, Select::All).tensors, state.tensors);
        };
        // Version 3: the model's safetensors bytes at the end of the checkpoint.
        restores_old(3, postcard::to_allocvec(&model).unwrap());
        // Version 4: no sums, the model in the file the checkpoint names.
        std::fs::write(files.model_file(3), &model).unwrap();
        restores_old(
            4,
            postcard::to_allocvec(&(3u64, model.len() as u64)).unwrap(),
        );
        std::fs::remove_file(files.model_file(3)).unwrap();
        files.next.set(0);
        let other = tempfile::tempdir().unwrap();

        // Version 7, as `write` writes it from a site whose residual and held broadcast wait in
        // files: read back into a fresh site, they go to its own files, bit for bit. Model
        // files a crash left before a checkpoint named them go too, or are written over, even
        // read-only (as the agent leaves its model files).
        let orphan = files.model_file(7);
        std::fs::write(&orphan, b"half a model").unwrap();
        let first = files.model_file(0);
        std::fs::write(&first, b"half a model").unwrap();
        let mut read_only = std::fs::metadata(&first).unwrap().permissions();
        read_only.set_readonly(true);
        std::fs::set_permissions(&first, read_only).unwrap();
        files.write(&spec, &site, &progress).unwrap();
        let mut expected = Vec::new();
        checkpoint::Layout::of_spec(&spec)
            .write_net(&site.net, &mut expected)
            .unwrap();
        assert_eq!(std::fs::read(&first).unwrap(), expected);
        assert!(
            std::fs::metadata(&files.model)
                .unwrap()
                .permissions()
                .readonly()
        );
        // `model.safetensors` is that file, not a copy.
        let inode = |p: &std::path::Path| {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(p).unwrap().ino()
        };
        assert_eq!(inode(&files.model), inode(&first));
        assert!(!orphan.exists());
        // What a fresh site restores, and the files it keeps its memory in meanwhile.
        let restored = |dir: &std::path::Path| {
            let mut s = fresh(dir);
            let p = files.restore(&spec, &mut s).unwrap();
            let mut kept: Vec<String> = std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            kept.sort();
            let m = s.memory().unwrap();
            (p, m, export(&s.net, &spec, Select::All).tensors, kept)
        };
        let (p, m, tensors, kept) = restored(other.path());
        assert_eq!(
            (p, m, tensors),
            (Some(progress.clone()), lossy.clone(), state.tensors.clone())
        );
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(
            kept[0].starts_with("training-base.held.")
                && kept[1].starts_with("training-base.residual.")
        );

        // The next checkpoint is a new file; the one before goes, and the link follows.
        let later = Progress {
            applied_version: Some(5),
            answered_rounds: vec![3, 4, 5],
            run: Some(unifed_protocol::RunId {
                created_ms: 1_796_000_000_000,
                nonce: 9,
            }),
        };
        files.write(&spec, &site, &later).unwrap();
        let second = files.model_file(1);
        assert!(!first.exists());
        assert_eq!(inode(&files.model), inode(&second));
        assert_eq!(restored(other.path()).0, Some(later.clone()));
        let progress_json: Progress =
            serde_json::from_slice(&std::fs::read(&files.progress).unwrap()).unwrap();
        assert_eq!(progress_json, later);

        // A checkpoint cut inside the memory or the model file's number, a model file of
        // another length or none, and a future version are errors; no checkpoint is a new site.
        let whole = std::fs::read(&files.checkpoint).unwrap();
        for cut in [20, whole.len() - 1] {
            std::fs::write(&files.checkpoint, &whole[..cut]).unwrap();
            assert!(
                files.restore(&spec, &mut fresh(other.path())).is_err(),
                "cut at {cut}"
            );
        }
        std::fs::write(&files.checkpoint, &whole).unwrap();
        let err = |files: &SiteFiles| {
            format!(
                "{:#}",
                files.restore(&spec, &mut fresh(other.path())).unwrap_err()
            )
        };
        std::fs::remove_file(&second).unwrap();
        std::fs::write(&second, &expected[..expected.len() - 1]).unwrap();
        let e = err(&files);
        assert!(
            e.contains("checkpoint.1.safetensors")
                && e.contains(&format!("names a model of {}", expected.len())),
            "{e}"
        );
        std::fs::remove_file(&second).unwrap();
        let e = err(&files);
        assert!(e.contains("checkpoint.1.safetensors"), "{e}");
        // A model file of the right length whose bytes changed (a root process writing into
        // `model.safetensors`, a damaged disk) is an error naming it.
        let mut changed = expected.clone();
        let last = changed.len() - 1;
        changed[last] ^= 1;
        std::fs::write(&second, &changed).unwrap();
        let e = err(&files);
        assert!(
            e.contains("checkpoint.1.safetensors") && e.contains("sum differs"),
            "{e}"
        );
        std::fs::remove_file(&second).unwrap();
        std::fs::write(&second, &expected).unwrap();
        assert_eq!(
            files.restore(&spec, &mut fresh(other.path())).unwrap(),
            Some(later.clone())
        );
        // So is a checkpoint whose bytes changed (here a value of the memory: its own sum is
        // the only check that sees it), or that has bytes after its sum.
        let mut bytes = whole.clone();
        let value = (-1.25f32).to_le_bytes();
        let at = bytes
            .windows(4)
            .position(|w| w == value)
            .expect("a held value");
        bytes[at] ^= 0x10;
        std::fs::write(&files.checkpoint, bytes).unwrap();
        let e = err(&files);
        assert!(
            e.contains("checkpoint.bin") && e.contains("sum differs"),
            "{e}"
        );
        let mut bytes = whole.clone();
        bytes.push(0);
        std::fs::write(&files.checkpoint, bytes).unwrap();
        assert!(err(&files).contains("bytes after its sum"));
        let mut bytes = whole.clone();
        bytes[4..8].copy_from_slice(&9u32.to_le_bytes());
        std::fs::write(&files.checkpoint, bytes).unwrap();
        assert!(err(&files).contains("format version 9 is not 7"));
        std::fs::remove_file(&files.checkpoint).unwrap();
        assert_eq!(
            files.restore(&spec, &mut fresh(other.path())).unwrap(),
            None
        );
    }
}
