// A reader for Python pickles (protocols 2 to 5, in-band data only) that builds a plain value tree
// instead of Python objects: what megatrain needs from Megatron-LM's torch.save'd checkpoints
// (dicts, lists, numbers, strings, argparse.Namespace, tensors) without Python.
//
// Nothing is ever imported or run. A GLOBAL becomes a `global` value naming "module.qualname";
// calling it (REDUCE, NEWOBJ) makes an `object` value that records the callable's name and its
// arguments, and BUILD records the object's state. Two Python built-ins are evaluated because
// every pickle of interest uses them for plain data: collections.OrderedDict() is a dict, and
// _codecs.encode(text, "latin1") is bytes (how protocol 2 spells bytes). A persistent id (torch's
// storages) becomes a `persistent` value holding the pickled id.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mt {

enum class PickleKind { none, boolean, integer, floating, string, bytes, list, tuple, dict, set, global, object, persistent };

struct PickleValue;
using PickleRef = std::shared_ptr<PickleValue>;

struct PickleValue {
  PickleKind kind = PickleKind::none;
  bool boolean = false;
  int64_t integer = 0;
  double floating = 0;
  std::string text;                                      // string, bytes, global/object: "module.qualname"
  std::vector<PickleRef> items;                          // list, tuple, set; object: the call's arguments; persistent: the id
  std::vector<std::pair<PickleRef, PickleRef>> entries;  // dict, in insertion order
  PickleRef state;                                       // object: what BUILD gave it (argparse.Namespace: a dict)
  bool newobj = false;  // object, written: made by NEWOBJ (cls.__new__) rather than called (REDUCE)

  bool is(PickleKind k) const { return kind == k; }
  bool is_object(std::string_view callable) const { return kind == PickleKind::object && text == callable; }
  // dict: the value under a string key; object: that attribute of its state dict. nullptr if absent.
  const PickleValue* find(std::string_view key) const;
  // As find, but throws mt::Error naming `key` and `where` when absent.
  const PickleValue& at(std::string_view key, std::string_view where) const;
  // "dict", "int", ... and, for objects and globals, their name.
  std::string describe() const;
};

// Unpickles `data`. Throws mt::Error naming `where` (the file) on malformed or unsupported input
// (out-of-band buffers, extension registry codes).
PickleRef read_pickle(const unsigned char* data, size_t size, const std::string& where);

}  // namespace mt
