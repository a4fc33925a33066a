//! Identifier newtypes. Ids are cheap to clone (`Arc<str>`) and carry a precomputed
//! [`stable_hash`] so hash-based policies never rehash a worker's name per request.

use std::fmt;
use std::sync::Arc;

use crate::hash::stable_hash;

/// The id of a worker (an engine replica). For a worker given by URL, its URL as given.
#[derive(Clone)]
pub struct WorkerId {
    name: Arc<str>,
    hash: u64,
}

impl WorkerId {
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        let name = name.into();
        let hash = stable_hash(name.as_bytes());
        Self { name, hash }
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// `stable_hash` of the id's bytes, computed once.
    pub fn hash64(&self) -> u64 {
        self.hash
    }
}

impl PartialEq for WorkerId {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.name == other.name
    }
}
impl Eq for WorkerId {}

impl std::hash::Hash for WorkerId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name.hash(state)
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl fmt::Debug for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WorkerId({:?})", &*self.name)
    }
}

/// The name a model is served under (the request's `model` field).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelId(Arc<str>);

impl ModelId {
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self(name.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for ModelId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ModelId({:?})", &*self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_id_equality_and_hash_follow_the_name() {
        let a = WorkerId::new("http://a:8000");
        let b = WorkerId::new(String::from("http://a:8000"));
        assert_eq!(a, b);
        assert_eq!(a.hash64(), b.hash64());
        assert_ne!(a, WorkerId::new("http://b:8000"));
        assert_eq!(a.to_string(), "http://a:8000");
    }
}
