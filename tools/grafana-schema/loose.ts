/**
 * Grafana's published types (@grafana/schema) declare fields such as thresholds.mode as TypeScript string enums
 * (ThresholdsMode.Absolute = "absolute"). By design a string enum never accepts the string literal a JSON file holds,
 * so a JSON dashboard can not be assigned to `Dashboard` as is. Loose<T> swaps every string enum for the union of its
 * values (`${E}`) and leaves every other type as it is: the check stays "only known fields, each of its declared
 * type, and enum fields hold one of the enum's values".
 */
export type Loose<T> = T extends string
  ? `${T}`
  : T extends readonly (infer U)[]
    ? Loose<U>[]
    : T extends object
      ? { [K in keyof T]: Loose<T[K]> }
      : T;
