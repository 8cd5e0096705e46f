#include "checkpoint/pickle_writer.h"

#include <cstring>

#include "core/error.h"

namespace mt {

namespace {

// The opcodes written (pickletools' names).
enum Op : unsigned char {
  kProto = 0x80, kStop = '.', kMark = '(', kNone = 'N', kTrue = 0x88, kFalse = 0x89, kBinInt = 'J', kBinInt1 = 'K',
  kBinInt2 = 'M', kLong1 = 0x8a, kBinFloat = 'G', kBinUnicode = 'X', kEmptyList = ']', kEmptyTuple = ')',
  kEmptyDict = '}', kTuple = 't', kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87, kAppends = 'e', kSetItems = 'u',
  kGlobal = 'c', kReduce = 'R', kNewObj = 0x81, kBuild = 'b', kBinPersId = 'Q',
};

class Pickler {
 public:
  std::string out;

  void op(Op o) { out.push_back(static_cast<char>(o)); }
  void le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }

  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      op(kBinInt1);
      le(static_cast<uint64_t>(v), 1);
    } else if (v >= 0 && v < 65536) {
      op(kBinInt2);
      le(static_cast<uint64_t>(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op(kBinInt);
      le(static_cast<uint32_t>(static_cast<int32_t>(v)), 4);
    } else {
      // LONG1: little-endian two's complement, as few bytes as keep the sign
      std::string bytes;
      uint64_t u = static_cast<uint64_t>(v);
      for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((u >> (8 * i)) & 0xff));
      while (bytes.size() > 1) {
        const auto last = static_cast<unsigned char>(bytes.back());
        const auto prev = static_cast<unsigned char>(bytes[bytes.size() - 2]);
        if ((last == 0 && !(prev & 0x80)) || (last == 0xff && (prev & 0x80))) bytes.pop_back();
        else break;
      }
      op(kLong1);
      le(bytes.size(), 1);
      out += bytes;
    }
  }

  void floating(double d) {
    uint64_t bits = 0;
    std::memcpy(&bits, &d, 8);
    op(kBinFloat);
    for (int i = 7; i >= 0; --i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));  // big-endian
  }

  void text(const std::string& s) {
    op(kBinUnicode);
    le(s.size(), 4);
    out += s;
  }

  void global(const std::string& name) {
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos || dot == 0 || dot + 1 == name.size())
      fail("write_pickle: '{}' is not a module.name global", name);
    op(kGlobal);
    out += name.substr(0, dot) + "\n" + name.substr(dot + 1) + "\n";
  }

  void tuple(const std::vector<PickleRef>& items) {
    if (items.empty()) return op(kEmptyTuple);
    if (items.size() > 3) op(kMark);
    for (const auto& i : items) value(*i);
    static const Op small[] = {kTuple1, kTuple2, kTuple3};
    op(items.size() <= 3 ? small[items.size() - 1] : kTuple);
  }

  void set_items(const std::vector<std::pair<PickleRef, PickleRef>>& entries) {
    if (entries.empty()) return;
    op(kMark);
    for (const auto& [k, v] : entries) {
      value(*k);
      value(*v);
    }
    op(kSetItems);
  }

  void value(const PickleValue& v) {
    switch (v.kind) {
      case PickleKind::none: op(kNone); break;
      case PickleKind::boolean: op(v.boolean ? kTrue : kFalse); break;
      case PickleKind::integer: integer(v.integer); break;
      case PickleKind::floating: floating(v.floating); break;
      case PickleKind::string: text(v.text); break;
      case PickleKind::bytes: {
        // latin-1 text of the bytes, as UTF-8
        std::string latin1;
        for (unsigned char c : v.text) {
          if (c < 0x80) {
            latin1.push_back(static_cast<char>(c));
          } else {
            latin1.push_back(static_cast<char>(0xc0 | (c >> 6)));
            latin1.push_back(static_cast<char>(0x80 | (c & 0x3f)));
          }
        }
        global("_codecs.encode");
        text(latin1);
        text("latin1");
        op(kTuple2);
        op(kReduce);
        break;
      }
      case PickleKind::list:
        op(kEmptyList);
        if (!v.items.empty()) {
          op(kMark);
          for (const auto& i : v.items) value(*i);
          op(kAppends);
        }
        break;
      case PickleKind::tuple: tuple(v.items); break;
      case PickleKind::dict:
        op(kEmptyDict);
        set_items(v.entries);
        break;
      case PickleKind::set:
        global("builtins.set");
        op(kEmptyList);
        if (!v.items.empty()) {
          op(kMark);
          for (const auto& i : v.items) value(*i);
          op(kAppends);
        }
        op(kTuple1);
        op(kReduce);
        break;
      case PickleKind::global: global(v.text); break;
      case PickleKind::object:
        global(v.text);
        tuple(v.items);
        op(v.newobj ? kNewObj : kReduce);
        set_items(v.entries);
        if (v.state) {
          value(*v.state);
          op(kBuild);
        }
        break;
      case PickleKind::persistent:
        if (v.items.size() != 1) fail("write_pickle: a persistent id holds {} values, not 1", v.items.size());
        value(*v.items[0]);
        op(kBinPersId);
        break;
    }
  }
};

PickleRef make(PickleKind k) {
  auto v = std::make_shared<PickleValue>();
  v->kind = k;
  return v;
}

}  // namespace

std::string write_pickle(const PickleValue& root) {
  Pickler p;
  p.op(kProto);
  p.out.push_back(2);
  p.value(root);
  p.op(kStop);
  return std::move(p.out);
}

PickleRef pickle_none() { return make(PickleKind::none); }

PickleRef pickle_bool(bool b) {
  PickleRef v = make(PickleKind::boolean);
  v->boolean = b;
  return v;
}

PickleRef pickle_int(int64_t i) {
  PickleRef v = make(PickleKind::integer);
  v->integer = i;
  return v;
}

PickleRef pickle_float(double d) {
  PickleRef v = make(PickleKind::floating);
  v->floating = d;
  return v;
}

PickleRef pickle_str(std::string s) {
  PickleRef v = make(PickleKind::string);
  v->text = std::move(s);
  return v;
}

PickleRef pickle_bytes(std::string b) {
  PickleRef v = make(PickleKind::bytes);
  v->text = std::move(b);
  return v;
}

PickleRef pickle_list(std::vector<PickleRef> items) {
  PickleRef v = make(PickleKind::list);
  v->items = std::move(items);
  return v;
}

PickleRef pickle_tuple(std::vector<PickleRef> items) {
  PickleRef v = make(PickleKind::tuple);
  v->items = std::move(items);
  return v;
}

PickleRef pickle_dict() { return make(PickleKind::dict); }

PickleRef pickle_global(std::string name) {
  PickleRef v = make(PickleKind::global);
  v->text = std::move(name);
  return v;
}

PickleRef pickle_object(std::string callable, std::vector<PickleRef> args, PickleRef state) {
  PickleRef v = make(PickleKind::object);
  v->text = std::move(callable);
  v->items = std::move(args);
  v->state = std::move(state);
  return v;
}

PickleRef pickle_new_object(std::string cls, PickleRef state) {
  PickleRef v = pickle_object(std::move(cls), {}, std::move(state));
  v->newobj = true;
  return v;
}

PickleRef pickle_ordered_dict() { return pickle_object("collections.OrderedDict"); }

PickleRef pickle_set(PickleValue& dict, PickleRef key, PickleRef value) {
  if (!dict.is(PickleKind::dict) && !dict.is(PickleKind::object))
    fail("pickle_set: a {} holds no dict items", dict.describe());
  dict.entries.emplace_back(std::move(key), value);
  return value;
}

PickleRef pickle_set(PickleValue& dict, const std::string& key, PickleRef value) {
  return pickle_set(dict, pickle_str(key), std::move(value));
}

}  // namespace mt
