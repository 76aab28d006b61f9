# A file's bytes as a C array, at build time:
#   cmake -DIN=set.pb -DOUT=set.c -DNAME=sym -P embed_bytes.cmake
# defines `const unsigned char sym[]` (IN's bytes, then a 0 not counted) and
# `const size_t sym_len`.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" digits)
math(EXPR len "${digits} / 2")
string(REPEAT "[0-9a-f]" 32 line) # 16 bytes a line
string(REGEX REPLACE "(${line})" "\\1\n" hex "${hex}")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
get_filename_component(in_name "${IN}" NAME)
file(WRITE "${OUT}.tmp"
  "/* Generated from ${in_name} by embed_bytes.cmake: do not edit. */\n"
  "#include <stddef.h>\n\n"
  "const unsigned char ${NAME}[] = {\n${bytes}0};\n"
  "const size_t ${NAME}_len = ${len};\n")
file(RENAME "${OUT}.tmp" "${OUT}")
