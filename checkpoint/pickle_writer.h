// Python pickles written from PickleValue trees (checkpoint/pickle.h), for torch.save files that
// Megatron-LM loads. Protocol 2, torch.save's, using only the opcodes torch.load's weights-only
// unpickler accepts (the default since PyTorch 2.6): no memo, no framing, strings as BINUNICODE,
// bytes as _codecs.encode(text, "latin1"), sets as builtins.set(list).
//
// How each kind is written:
//   none, boolean, integer (any int64), floating, string   as Python's own
//   bytes                                                 _codecs.encode(latin-1 text, "latin1")
//   list, tuple, dict (entries in order), set             as Python's own (set: builtins.set([...]))
//   global                                                the object "module.qualname"
//   object                                                callable(*items) (REDUCE; NEWOBJ when `newobj`:
//                                                         cls.__new__(cls, *items)), then `entries` as
//                                                         its dict items (an OrderedDict's), then
//                                                         BUILD with `state` when set
//   persistent                                            the id items[0], then BINPERSID (torch's
//                                                         storages)
// A global's name splits at its last dot into module and name ("torch._utils._rebuild_tensor_v2").
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/pickle.h"

namespace mt {

std::string write_pickle(const PickleValue& root);

// Building values.
PickleRef pickle_none();
PickleRef pickle_bool(bool b);
PickleRef pickle_int(int64_t i);
PickleRef pickle_float(double d);
PickleRef pickle_str(std::string s);
PickleRef pickle_bytes(std::string b);
PickleRef pickle_list(std::vector<PickleRef> items = {});
PickleRef pickle_tuple(std::vector<PickleRef> items = {});
PickleRef pickle_dict();
PickleRef pickle_global(std::string name);
// callable(*args); `state` (may be null) given to BUILD.
PickleRef pickle_object(std::string callable, std::vector<PickleRef> args = {}, PickleRef state = nullptr);
// cls.__new__(cls) (NEWOBJ, as pickle saves a dataclass), then BUILD with `state` when set.
PickleRef pickle_new_object(std::string cls, PickleRef state = nullptr);
// collections.OrderedDict(), filled with pickle_set.
PickleRef pickle_ordered_dict();
// Appends key -> value to a dict (or an OrderedDict object); returns `value`.
PickleRef pickle_set(PickleValue& dict, const std::string& key, PickleRef value);
PickleRef pickle_set(PickleValue& dict, PickleRef key, PickleRef value);

}  // namespace mt
